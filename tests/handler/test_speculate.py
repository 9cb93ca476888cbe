"""handler/engine/speculate.py and the engine's speculative steps: n-gram drafts come from the request's own
latest earlier occurrence; a verify step's rows (one sequence at consecutive positions) give the
logits and K/V of plain decode steps bit for bit, on any thread split; speculation changes no answer
(greedy tokens, stop strings, max_tokens, requests that cannot be drafted beside ones that are) while
it does take drafted tokens; a draft never takes a block the pool does not have free."""

from __future__ import annotations

import pytest
import torch

from handler.model import small_gemm
from handler.engine.engine import Engine
from handler.engine.sampling import SamplingParams
from handler.engine.speculate import NgramIndex, accepted, can_draft
from tests.handler.test_decode_step import _engine, _prefilled_rows

needs_c = pytest.mark.skipif(not small_gemm.available(), reason="CPU kernels not built here (no cc or AVX2)")


def test_ngram_index_continues_the_latest_longest_match():
    ix = NgramIndex()
    ix.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # suffix (2, 3): last seen followed by 7 (positions 5-6), not by 9; then what followed the 7
    assert ix.propose(3) == [7, 5, 2]
    ix.extend([7])
    assert ix.propose(2) == [5, 2]  # (2, 3, 7) occurred once before
    ix.extend([6])  # 6 never seen, nor (7, 6) or (3, 7, 6)
    assert ix.propose(3) == []
    single = NgramIndex()
    single.extend([5, 8, 5])  # one repeated token: what followed it
    assert single.propose(2) == [8, 5]


def test_sync_indexes_prompt_and_output_as_they_grow():
    prompt, out = [4, 5, 6, 4, 5], []
    grown = NgramIndex()
    for tok in [6, 1, 4, 5]:
        grown.sync(prompt, out)
        out.append(tok)
    grown.sync(prompt, out)
    whole = NgramIndex()
    whole.extend(prompt + out)
    assert len(grown) == len(whole) == 9
    assert grown.propose(4) == whole.propose(4) == [6, 1, 4, 5]


def test_accepted_takes_tokens_up_to_the_first_wrong_draft():
    assert accepted([7, 8, 9], [7, 8, 1, 2]) == [7, 8, 1]  # d3 = 9 is not t2 = 1: t3 is dropped
    assert accepted([7, 8], [7, 8, 3]) == [7, 8, 3]  # every draft right: one more token
    assert accepted([7], [6, 5]) == [6]
    assert accepted([], [6]) == [6]


def test_only_argmax_requests_are_drafted():
    from handler.engine.sampling import RowState

    def ok(**kw):
        p = SamplingParams(**kw)
        return can_draft(p, RowState(p, [1], torch.device("cpu"), 100))

    assert ok(temperature=0.0)
    assert not ok(temperature=0.7)
    assert not ok(temperature=0.0, logprobs=0)
    assert not ok(temperature=0.0, frequency_penalty=0.5)
    assert not ok(temperature=0.0, logit_bias={3: 1.0})


@needs_c
@pytest.mark.parametrize("parallel_min", [0, small_gemm.PARALLEL_MIN])
@pytest.mark.parametrize("threads", [1, 2])
def test_verify_rows_equal_plain_decode_steps_bit_for_bit(parallel_min, threads, dev_model, monkeypatch):
    """Rows p..p+4 of one sequence in one step (each reading the K/V the rows before it write in that
    step) against five one-row steps, beside another sequence's row; the first draft row straddles a
    block boundary."""
    monkeypatch.setattr(small_gemm, "PARALLEL_MIN", parallel_min)  # 0: per-row work split over threads too
    e, slots = _engine(dev_model)
    (first, other), (slot, other_slot) = _prefilled_rows(e, slots[1:3], [30, 17], seed=3)
    _, p, table = first
    assert p == 30 and len(table) == 2  # positions 0-31: the rows at 32-34 need a third block
    table = table + [next(b for b in range(e.kv.num_blocks) if b not in table and b not in other[2])]
    tokens = [first[0], 11, 42, 11, 7]
    kv = lambda: (e.kv.k.clone(), e.kv.v.clone())  # noqa: E731
    start = kv()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        plain = torch.cat([e.decode_step([(t, p + i, table)], [slot]) for i, t in enumerate(tokens)])
        plain_kv = kv()
        e.kv.k.copy_(start[0])
        e.kv.v.copy_(start[1])
        rows = [(t, p + i, table) for i, t in enumerate(tokens)]
        both = e.decode_step([other, *rows], [other_slot] + [slot] * len(rows))
        # in any order: the last position's row first still reads the K/V of the rows after it
        e.kv.k.copy_(start[0])
        e.kv.v.copy_(start[1])
        reverse = e.decode_step(rows[::-1], [slot] * len(rows))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(both[1:], plain)
    assert torch.equal(reverse, plain.flip(0))
    # other's row wrote its own K/V too; the sequence's five positions hold what plain steps wrote
    bs = e.kv.block_size
    at = torch.tensor([table[q // bs] * bs + q % bs for q in range(p, p + len(tokens))])
    for got, want in zip(kv(), plain_kv):
        flat, ref = got.view(got.shape[0], -1, *got.shape[3:]), want.view(want.shape[0], -1, *want.shape[3:])
        assert torch.equal(flat[:, at], ref[:, at])


def _run(e: Engine, requests: list[tuple[list[int], SamplingParams, str | None]]) -> list[tuple[list[int], str, str]]:
    """(tokens, text, finish reason) of each request, all submitted at once and stepped to the end."""
    got = [([], [], []) for _ in requests]

    def sink(ev, out):
        if ev.token_id is not None:
            out[0].append(ev.token_id)
        out[1].append(ev.text)
        if ev.finished:
            out[2].append(ev.finish_reason)

    for i, (prompt, params, adapter) in enumerate(requests):
        e.add_request(f"r{i}", prompt, params, adapter, lambda ev, o=got[i]: sink(ev, o))
    while e.step():
        pass
    return [(toks, "".join(text), reasons[0]) for toks, text, reasons in got]


@needs_c
def test_speculation_changes_no_answer_and_takes_drafted_tokens(dev_model, one_torch_thread):
    g = lambda n, **kw: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)  # noqa: E731
    loop = [5, 6, 7, 8] * 6  # a prompt that repeats itself: drafts from the first step
    requests = [
        (loop, g(40), "a16"),
        (loop, g(40), None),
        (list(range(20, 45)), g(33), "b8"),
        (loop + [9, 10], g(25, stop=["zz"]), "c4"),
        (loop, SamplingParams(max_tokens=20, temperature=0.8, seed=3), "a16"),  # sampled: never drafted
        (loop, g(20, logprobs=2), None),  # logprobs: never drafted
        (loop, g(2), "a16"),  # one token left after the first: no draft fits its max_tokens
    ]
    plain, _ = _engine(dev_model, speculate=0)
    spec, _ = _engine(dev_model, speculate=4, speculate_max_rows=16)  # drafts beside all seven from the start
    assert spec.speculate == 4 and plain.speculate == 0
    want, got = _run(plain, requests), _run(spec, requests)
    assert got == want
    assert [len(got[i][0]) for i in (0, 1, 2, 4, 5, 6)] == [40, 40, 33, 20, 20, 2]
    s = spec.stats()
    assert s.speculative_drafted > 0 and 0 < s.speculative_accepted <= s.speculative_drafted
    assert spec.stats().generated_tokens_total == plain.stats().generated_tokens_total
    assert plain.stats().speculative_drafted == 0


@needs_c
def test_answers_unchanged_when_the_cache_runs_out(dev_model, one_torch_thread):
    """A cache of 6 blocks for three requests of 4 blocks each: requests are preempted and recomputed,
    drafts stop where the free blocks end (a draft never preempts), and every answer is still plain
    decoding's."""
    from handler.model.kvcache import KVCache

    def engine(speculate):
        c = Engine(dev_model, device="cpu", kv_cache_bytes=8 << 20, max_batch=4).config
        per_tok = KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
        return Engine(dev_model, device="cpu", kv_cache_bytes=6 * 16 * per_tok, max_batch=4, block_size=16,
                      speculate=speculate)

    g = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = [([5, 6, 7, 8] * 5, g, None), ([9, 3, 9, 4] * 5, g, None), (list(range(30, 50)), g, None)]
    plain, spec = engine(0), engine(4)
    assert spec.kv.capacity_tokens == 96
    want, got = _run(plain, requests), _run(spec, requests)
    assert got == want
    assert spec.stats().preemptions >= 1 and plain.stats().preemptions >= 1
    assert spec.stats().speculative_accepted > 0
    assert spec.kv.free_blocks == plain.kv.free_blocks == 6  # every block back
