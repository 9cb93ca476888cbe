"""Issue 35 (items 2-4), the fair queues themselves, deterministically (no clocks): the order in which
`handler.threads.TenantQueues` serves tenants, its caps, `FairThreadPool` (the prep threads and the
grammar builds) and the prompt bounds of `handler.serving.prep.TokenBound` against the real
tokenizers."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from handler.serving.prep import CUT_SLACK, TokenBound, _cuts
from handler.threads import FairThreadPool, QueueFull, TenantQueues
from tests.handler.conftest_service import wait_until

REAL_MODEL = Path(__file__).resolve().parents[2] / ".cache/lorafarm/realmodel/models/smollm2-135m-instruct"


def drain(q: TenantQueues) -> list[str]:
    """Pop everything, one running at a time per pop (done at once): the service order of tenants."""
    out = []
    while (nxt := q.pop()) is not None:
        tenant, item = nxt
        out.append(item)
        q.done(tenant)
    return out


def test_round_robin_across_tenants_not_first_come_first_served():
    q = TenantQueues(tenant_cap=100, total_cap=1000)
    for i in range(5):
        q.push("attacker", f"a{i}")
    q.push("victim", "v0")
    q.push("victim", "v1")
    q.push("other", "o0")
    assert drain(q) == ["a0", "v0", "o0", "a1", "v1", "a2", "a3", "a4"]
    assert len(q) == 0 and q.tenants() == {}


def test_deficit_round_robin_by_cost():
    """Cost = bytes: a tenant of 900 KB jobs gets a turn per ~900 KB of credit, one of 18 KB jobs many."""
    q = TenantQueues(tenant_cap=100, total_cap=1000, quantum=64 * 1024)
    for i in range(3):
        q.push("attacker", f"A{i}", 900 * 1024)
    for i in range(40):
        q.push("victim", f"v{i}", 18 * 1024)
    order = drain(q)
    first_a = order.index("A0")
    # the victim is served its quantum's worth (3 x 18 KB per 64 KB turn) every turn while the
    # attacker banks credit for its first 900 KB job: 14 turns
    assert order[:first_a].count("A0") == 0 and first_a >= 30, order
    assert sorted(order) == sorted([f"A{i}" for i in range(3)] + [f"v{i}" for i in range(40)])


def test_a_tenant_at_its_running_cap_is_skipped_and_keeps_its_queue():
    q = TenantQueues(tenant_cap=100, total_cap=1000, running_cap=1)
    q.push("attacker", "a0")
    q.push("attacker", "a1")
    assert q.pop() == ("attacker", "a0")  # running: its next waits although a server is free
    assert q.pop() is None
    q.push("victim", "v0")
    assert q.pop() == ("victim", "v0")
    assert q.tenants() == {"attacker": {"waiting": 1, "running": 1}, "victim": {"waiting": 0, "running": 1}}
    q.done("attacker")
    assert q.pop() == ("attacker", "a1")


def test_a_tenants_backlog_never_refuses_another():
    q = TenantQueues(tenant_cap=16, total_cap=20, running_cap=1)
    n = 0
    while q.admits("attacker"):
        q.push("attacker", n)
        n += 1
    assert n == 16  # its own cap
    for k in range(10):  # other tenants: each admitted while under its share of the shared cap
        assert q.admits(f"t{k}")
        q.push(f"t{k}", "x")
    assert len(q) == 26 and not q.admits("attacker")
    assert not q.admits("t0")  # over the shared cap, t0 already holds its share (20 // 11 tenants = 1)
    assert q.admits("newcomer")  # nothing waiting: always admitted


def test_remove_a_waiting_item_whose_requester_left():
    q = TenantQueues()
    q.push("a", "x")
    q.push("a", "y")
    assert q.remove("a", "x") and not q.remove("a", "x")
    assert q.remove("a", "y") and q.tenants() == {} and len(q) == 0
    assert q.pop() is None


def test_random_interleavings_keep_the_counts_and_serve_everyone():
    rng = random.Random(7)
    q = TenantQueues(tenant_cap=1000, total_cap=10000, running_cap=2, quantum=5)
    pushed, served, running = [], [], []
    for step in range(3000):
        r = rng.random()
        if r < 0.5:
            t = rng.choice("abcd")
            item = (t, step)
            q.push(t, item, rng.randint(1, 20))
            pushed.append(item)
        elif r < 0.8:
            nxt = q.pop()
            if nxt is not None:
                assert q.running_of(nxt[0]) <= 2
                running.append(nxt)
                served.append(nxt[1])
        elif running:
            t, _ = running.pop(rng.randrange(len(running)))
            q.done(t)
        assert q.waiting == sum(q.waiting_of(t) for t in "abcd") == len(pushed) - len(served)
    for t, _ in running:
        q.done(t)
    served += drain(q)
    assert sorted(served) == sorted(pushed)


def test_fair_thread_pool_runs_another_tenants_job_while_one_tenant_backs_up():
    """Two threads, a tenant on at most one: while the attacker's job blocks, its queued jobs wait and
    the victim's jobs run; a full tenant queue is QueueFull; a cancelled waiting job never runs."""

    async def main():
        pool = FairThreadPool(2, name="test-fair", tenant_cap=3, total_cap=64).start()
        gate, started, ran = threading.Event(), threading.Event(), []

        def block():
            started.set()
            gate.wait()

        try:
            blocker = asyncio.ensure_future(pool.run("attacker", 1, block))
            await asyncio.to_thread(started.wait)  # the attacker holds a thread
            queued = [asyncio.ensure_future(pool.run("attacker", 1, ran.append, f"a{i}")) for i in range(3)]
            await asyncio.sleep(0)
            with pytest.raises(QueueFull):
                await pool.run("attacker", 1, ran.append, "a-over")
            for i in range(5):  # the victim's jobs complete while the attacker's wait
                await pool.run("victim", 1, ran.append, f"v{i}")
            assert ran == [f"v{i}" for i in range(5)]
            st = pool.stats()
            assert st["tenants"]["attacker"] == {"waiting": 3, "running": 1} and st["refused"] == 1
            queued[0].cancel()  # its requester left: dropped, never run
            await asyncio.gather(queued[0], return_exceptions=True)
            gate.set()
            await blocker
            await asyncio.gather(*queued[1:])
            assert ran[5:] == ["a1", "a2"] and pool.stats()["cancelled"] == 1
            with pytest.raises(ZeroDivisionError):  # a job's exception goes to its caller
                await pool.run("victim", 1, lambda: 1 / 0)
            assert pool.stats()["tenants"] == {}
        finally:
            gate.set()
            pool.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def tokenizers(dev_model):
    from transformers import AutoTokenizer

    out = {"dev": AutoTokenizer.from_pretrained(str(dev_model))}
    if REAL_MODEL.exists():
        out["real"] = AutoTokenizer.from_pretrained(str(REAL_MODEL))
    return out


def _texts(rng: random.Random) -> list[str]:
    words = ["lorem", "ipsum", "dolor", "sit", "amet,", "x=1;", "\n\n", "  ", "caf\u00e9", "\u4e2d\u6587", "!!!",
             "don't", "https://a.b/c?d=e", "\t", "1234567", "....", "\U0001F600", "#", "--", "\r\n"]
    out = []
    for _ in range(6):
        n = rng.randint(20000, 60000)
        out.append(" ".join(rng.choice(words) for _ in range(n // 6)))
    out.append("lorem ipsum " * 20000)
    out.append("a" * 100000)  # no cut at all: only the byte bound applies
    out.append(" " * 50000 + "x " * 30000)
    return out


def test_prompt_bounds_are_lower_bounds_of_the_real_count(tokenizers):
    """Never refuse a prompt that fits: every bound is <= the whole text's token count, for texts of
    many shapes, under and over the limit, on the dev and the real tokenizer."""
    rng = random.Random(3)
    texts = _texts(rng)
    for name, tok in tokenizers.items():
        bound = TokenBound.of(tok)
        assert bound.max_token_bytes and bound.chunked, (name, bound.max_token_bytes, bound.chunked)
        for text in texts:
            whole = len(tok.encode(text, add_special_tokens=False))
            assert bound.by_bytes(text) <= whole, name
            for limit in (512, 2048, 8192, whole, whole + 1, 10**9):
                least = bound.least_tokens(text, limit)
                assert least is None or least <= whole, (name, limit, least, whole)
                if least is not None:
                    assert least >= limit
            # chunked counting itself: within the slack per cut of the whole count
            cuts = _cuts(text, 4096)
            start, parts = 0, 0
            for end in [*cuts, len(text)]:
                parts += len(tok.encode(text[start:end], add_special_tokens=False))
                start = end
            assert 0 <= parts - whole <= CUT_SLACK * len(cuts), (name, parts, whole, len(cuts))


def test_a_huge_prompt_is_refused_after_tokenizing_a_prefix_only(tokenizers):
    """A 900 KB prompt under the byte bound (the real tokenizer's L is ~82 bytes) is proven past an
    8,192-token context by tokenizing its first chunk, not the whole text."""
    tok = tokenizers.get("real") or tokenizers["dev"]
    bound = TokenBound.of(tok)
    text = "lorem ipsum dolor sit amet, " * 32000
    calls = []
    real_encode = tok.encode

    def counting_encode(t, **kw):
        calls.append(len(t))
        return real_encode(t, **kw)

    bound.max_token_bytes = None  # the incremental path alone
    tok.encode = counting_encode
    try:
        least = bound.least_tokens(text, 8192)
    finally:
        del tok.encode
    assert least is not None and least >= 8192
    assert sum(calls) < len(text) // 10, calls


# ------------------------------------------------------------------ the grammar pool, real workers


def _pattern(n: int) -> dict:
    """The issue's slow-to-refuse schema (a 400 after ~0.2 s of a worker once it runs: these never run here)."""
    return {"kind": "json_schema", "schema": {"type": "string", "pattern": "^(a{1000}){%d}$" % n}}


def _small(i: int) -> dict:
    return {"kind": "json_schema", "schema": {"type": "object", "properties": {f"v{i}": {"type": "integer"}},
                                              "required": [f"v{i}"]}}


def test_grammar_pool_is_round_robin_by_tenant_and_cancels_what_nobody_waits_for(tokenizers, monkeypatch):
    """An attacker holds its one worker slot (a compile that hangs) and fills its own queue; its next
    compile is a 429 (GrammarBusy) but the victim's compiles all run on the other worker meanwhile.
    When the attacker's callers are cancelled, its queued compiles leave the queue and the hanging
    one's worker is killed; the attacker's slot is free once the replacement worker is up."""
    from handler.grammar import constrained
    from handler.grammar.pool import FAULT_ENV, FAULT_TITLE, GrammarBusy, GrammarPool

    monkeypatch.setenv(FAULT_ENV, "hang")  # read in the worker processes only
    tok = tokenizers["dev"]

    async def main():
        pool = GrammarPool(constrained.tokenizer_spec(tok, len(tok)), workers=2, timeout_s=600, tenant_waiting=4)
        await pool.start()
        try:
            hold = asyncio.ensure_future(pool.compile(
                {"kind": "json_schema", "schema": {"title": FAULT_TITLE, "type": "object"}}, "attacker"))
            holding = {"waiting": 0, "running": 1}
            assert await wait_until(lambda: pool.stats()["tenants"].get("attacker") == holding, 180), "hold"
            queued = [asyncio.ensure_future(pool.compile(_pattern(400 + i), "attacker")) for i in range(4)]
            assert await wait_until(lambda: pool.stats()["waiting"] == 4, 180), "attacker's queue"
            with pytest.raises(GrammarBusy):
                await pool.compile(_pattern(999), "attacker")
            for i in range(6):  # distinct new schemas of another tenant: none waits, none refused
                assert (await pool.compile(_small(i), "victim")).grammar
            st = pool.stats()
            assert st["tenants"] == {"attacker": {"waiting": 4, "running": 1}} and st["busy"] == 1
            assert not any(t.done() for t in [hold, *queued])  # the victim finished while all of these waited
            for t in [hold, *queued]:
                t.cancel()
            await asyncio.gather(hold, *queued, return_exceptions=True)
            assert pool.stats()["waiting"] == 0 and pool.cancelled == 5
            assert await wait_until(lambda: pool.stats()["tenants"] == {} and pool.alive == 2
                                    and pool.stats()["idle"] == 2, 180), "killed worker replaced, slot free"
            assert pool.compiles == 7  # the hang + the victim's 6: no queued compile ever ran
            assert (await pool.compile(_small(0), "attacker")).grammar
        finally:
            await pool.close()

    asyncio.run(main())
