"""Fair embedding batches (issue 21, item 6): the scheduling order of `handler.embed.model.FairQueue` and
`EmbeddingBatcher`, deterministically (no clocks): which rows go into which batch."""

from __future__ import annotations

import asyncio
import threading

import torch

from handler.embed.model import EmbeddingBatcher, FairQueue, _Job
from tests.waiting import wait_until


def _job(loop, rows: int, tokens: int, flow: str = "") -> _Job:
    return _Job(ids=[[1] * tokens for _ in range(rows)], future=loop.create_future(), flow=flow,
                out=[None] * rows)


def _flows(batch) -> list[str]:
    return [j.flow for j, _ in batch]


def test_small_request_after_a_huge_one_is_in_the_next_batch():
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(max_batch=32, quantum=128)
        huge = _job(loop, 2048, 120, "attacker")
        q.push(huge)
        first = q.next_batch()
        assert len(first) == 32 and set(_flows(first)) == {"attacker"}
        small = _job(loop, 1, 5, "victim")
        q.push(small)
        second = q.next_batch()
        assert len(second) == 32
        assert (small, 0) in second
        # the huge request goes on in later batches, in order, every row exactly once
        seen = [i for j, i in first + second if j is huge]
        while q:
            seen += [i for j, i in q.next_batch() if j is huge]
        assert seen == list(range(2048))
    finally:
        loop.close()


def test_deficit_round_robin_shares_tokens_not_rows():
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(max_batch=1000, quantum=100)
        long_rows = _job(loop, 100, 100, "long")
        short_rows = _job(loop, 1000, 10, "short")
        q.push(long_rows)
        q.push(short_rows)
        batch = q.next_batch()
        tokens = {"long": 0, "short": 0}
        for j, i in batch:
            tokens[j.flow] += len(j.ids[i])
        # each round: one 100-token row of one tenant, ten 10-token rows of the other
        assert abs(tokens["long"] - tokens["short"]) <= 100, tokens
    finally:
        loop.close()


def test_a_tenants_requests_share_its_turns_in_chunks():
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(max_batch=8, quantum=1000, request_chunk=4)
        a1 = _job(loop, 100, 1, "t")
        a2 = _job(loop, 2, 1, "t")
        q.push(a1)
        q.push(a2)
        batch = q.next_batch()
        # a1 gives its chunk of 4 rows, then a2 (same tenant) goes on: done in the first batch
        assert [j is a2 for j, _ in batch].count(True) == 2
        assert [j for j, _ in batch[:4]] == [a1] * 4
    finally:
        loop.close()


def test_requests_without_a_tenant_are_flows_of_their_own():
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(max_batch=4, quantum=10)
        big, small = _job(loop, 50, 10), _job(loop, 1, 10)
        q.push(big)
        q.push(small)
        assert (small, 0) in q.next_batch()
    finally:
        loop.close()


def test_many_tenants_each_get_a_row_per_round_and_token_cap_bounds_a_batch():
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(max_batch=32, quantum=128, max_batch_tokens=400)
        jobs = [_job(loop, 10, 100, f"t{k}") for k in range(8)]
        for j in jobs:
            q.push(j)
        b1 = q.next_batch()
        assert len(b1) == 4 and len(set(_flows(b1))) == 4  # 4 x 100 tokens: the token cap
        b2 = q.next_batch()
        assert set(_flows(b2)).isdisjoint(_flows(b1))  # the next batch starts with the others
    finally:
        loop.close()


def test_cancelled_requests_are_skipped():
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(max_batch=8, quantum=100)
        gone, kept = _job(loop, 20, 1, "a"), _job(loop, 2, 1, "b")
        q.push(gone)
        q.push(kept)
        gone.future.cancel()
        assert [j for j, _ in q.next_batch()] == [kept, kept]
        assert not q
    finally:
        loop.close()


class _GatedEncoder:
    """Records each batch; the first batch waits on `gate` (so requests can arrive while it runs)."""

    max_tokens = 128

    def __init__(self):
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def embed_ids(self, ids):
        self.started.set()
        if not self.batches:
            self.gate.wait(timeout=60)
        self.batches.append([r[0] for r in ids])
        return torch.tensor([[float(r[0]), float(len(r))] for r in ids])


async def test_batcher_serves_a_small_request_within_one_batch_of_a_huge_one():
    enc = _GatedEncoder()
    b = EmbeddingBatcher(enc, max_batch=32)
    b.start()
    try:
        huge_ids = [[1000 + i] + [7] * 119 for i in range(2048)]
        huge = asyncio.create_task(b.embed(huge_ids, "attacker"))
        await wait_until(enc.started.is_set, 60, interval=0.01, what="the first batch running")
        small = asyncio.create_task(b.embed([[5, 6, 7]], "victim"))
        await asyncio.sleep(0)  # the small request is queued while the first batch runs
        enc.gate.set()
        out = await small
        assert out.tolist() == [[5.0, 3.0]]
        assert not huge.done()
        batch_of_small = next(k for k, batch in enumerate(enc.batches) if 5 in batch)
        assert batch_of_small == 1  # the batch right after the one that was running
        got = await huge
        assert got[:, 0].tolist() == [float(1000 + i) for i in range(2048)]  # rows back in order
        assert b.running == 0 and b.in_flight_inputs == 0
    finally:
        await b.stop()
