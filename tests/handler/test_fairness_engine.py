"""Fair scheduling in the engine (issue 35, item 1), on the dev model, by steps and order (never by
time): a tenant's n=16 requests no longer hold the batch against another tenant's short ones, the
attacker still progresses, greedy output is unchanged, one tenant alone is served exactly as first
come first served, weights split the rows, a deferred prefix block never blocks another tenant, and
a full KV cache preempts the tenant over its share; while tenants contend a step decodes at most
`contended_rows` rows, taking turns, and a newcomer's short prefill gets a small step."""

from __future__ import annotations

import pytest

from handler.engine.config import CPU_CONTENDED_ROWS
from handler.engine.engine import Engine, SamplingParams, TokenEvent
from handler.engine.scheduler import CONTENDED_LINGER_S
from lorafarm.dev.adapters import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PER_TOKEN = 2 * 4 * 2 * 32 * 4  # bytes of K and V per token of the tiny dev model, float32


def chat_ids(tok, prompt: str) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


class Steps:
    """Every event with the engine step that produced it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.first: dict[str, int] = {}  # request -> step of its first token
        self.done: dict[str, int] = {}  # request -> step of its final event
        self.reason: dict[str, str] = {}
        self.per_step: dict[int, dict[str, int]] = {}  # step -> request prefix -> tokens
        self.steps_of: dict[str, list[int]] = {}  # request -> the steps that gave it a token

    def __call__(self, ev: TokenEvent) -> None:
        step = self.engine.scheduler.steps
        if ev.token_id is not None:
            self.tokens.setdefault(ev.request_id, []).append(ev.token_id)
            self.first.setdefault(ev.request_id, step)
            self.steps_of.setdefault(ev.request_id, []).append(step)
            bucket = self.per_step.setdefault(step, {})
            bucket[ev.request_id[0]] = bucket.get(ev.request_id[0], 0) + 1
        if ev.finished:
            self.done[ev.request_id] = step
            self.reason[ev.request_id] = ev.finish_reason


def drain(engine: Engine, limit: int = 20_000) -> int:
    n = 0
    while engine.step():
        n += 1
        assert n < limit
    return n


@pytest.fixture(scope="module")
def tok_engine(dev_model):
    return Engine(dev_model, device="cpu", kv_cache_bytes=1 << 20, max_batch=2, rank_pools={})


@pytest.fixture(scope="module")
def prompts(tok_engine):
    return [chat_ids(tok_engine.tokenizer, p) for p in random_prompts(seed=35, count=40)]


ATTACK = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


class PrefillCount:
    """Prompt tokens the scheduler's prefill chunks computed, recompute included."""

    def __init__(self, engine: Engine):
        self.tokens, self._prefilled = 0, engine.scheduler.prefilled
        engine.scheduler.prefilled = self

    def __call__(self, r, n: int) -> None:
        self.tokens += n
        self._prefilled(r, n)


def run_attack(dev_model, prompts, scheduling: str, **kw):
    """Four requests of n=16 (64 engine requests, 600 tokens each) fill the batch of 32 rows; then
    another tenant sends 4 short requests. Returns (engine, steps, the step the victim arrived)."""
    e = Engine(dev_model, device="cpu", kv_cache_bytes=64 << 20, max_batch=32, rank_pools={},
               scheduling=scheduling, **kw)
    col = Steps(e)
    e.prefill_count = PrefillCount(e)
    for j in range(4):
        for i in range(16):
            e.add_request(f"a{j}.{i}", prompts[j], ATTACK, None, col, cache_salt="attacker")
    for _ in range(3):
        e.step()
    assert e.stats().running == 32 and e.stats().waiting == 32
    arrived = e.scheduler.steps
    for i in range(4):
        e.add_request(f"v{i}", prompts[10 + i], SHORT, None, col, tenant="victim")
    drain(e)
    return e, col, arrived


@pytest.fixture(scope="module")
def attack_runs(dev_model, prompts):
    runs = {s: run_attack(dev_model, prompts, s) for s in ("fair", "fifo")}
    runs["fair-uncapped"] = run_attack(dev_model, prompts, "fair", contended_rows=32)
    return runs


def test_victim_admitted_at_once_while_the_attacker_holds_the_batch(attack_runs, prompts):
    e, col, arrived = attack_runs["fair"]
    assert e.scheduler.contended_rows == CPU_CONTENDED_ROWS == 8  # the CPU's default
    victims = [f"v{i}" for i in range(4)]
    # every victim request gets its first token in the very next step, and ends 15 steps later
    assert [col.first[v] - arrived for v in victims] == [1, 1, 1, 1]
    assert [col.done[v] - arrived for v in victims] == [16, 16, 16, 16]
    # by taking 4 rows from the attacker (over its share of 16), never more, and no KV preemption;
    # the 4 requests it gave way are parked with their cache: no prompt token is computed twice
    st = e.stats()
    assert st.preemptions_share == 4 and st.preemptions_kv == 0 and st.preemptions == 4
    assert e.prefill_count.tokens == sum(len(prompts[j]) for j in range(4)) * 16 + sum(
        len(prompts[10 + i]) for i in range(4))
    # while the victims run a step decodes 8 rows: the victims' 4 and 4 of the attacker's 28,
    # which take turns: each attacker row decodes at least once in any 7 consecutive steps
    for step in range(arrived + 2, arrived + 17):
        assert col.per_step[step] == {"a": 4, "v": 4}, step
    window = range(arrived + 2, arrived + 17)
    rows = {r: [s for s in col.steps_of[r] if s in window] for r in col.steps_of if r.startswith("a")}
    rows = {r: steps for r, steps in rows.items() if steps}
    assert len(rows) == 28  # the 4 parked requests wait; the others all decode
    for r, mine in rows.items():
        gaps = [b - a for a, b in zip([window.start - 1, *mine], [*mine, window.stop])]
        assert max(gaps) <= 7, (r, mine)
    attackers = [r for r in col.tokens if r.startswith("a")]
    assert len(attackers) == 64 and all(len(col.tokens[r]) == 600 for r in attackers)
    assert all(col.reason[r] == "length" for r in col.reason)
    # what the engine reports per tenant
    rep = e.tenant_stats()
    assert rep.named["victim"].generated_tokens == 64 and rep.named["attacker"].generated_tokens == 64 * 600
    assert rep.named["attacker"].preempted == {"kv": 0, "share": 4}
    assert rep.named["victim"].queue_count == 4 and rep.named["attacker"].queue_count == 64
    assert rep.active == [] and e.stats().tenants_active == 0


def test_uncapped_contended_steps_decode_every_row(attack_runs):
    # --contended-rows 32 (an accelerator's default): the attacker's 28 rows decode in every step
    e, col, arrived = attack_runs["fair-uncapped"]
    assert [col.first[f"v{i}"] - arrived for i in range(4)] == [1, 1, 1, 1]
    for step in range(arrived + 2, arrived + 17):
        assert col.per_step[step] == {"a": 28, "v": 4}, step
    assert attack_runs["fair"][1].tokens == col.tokens  # greedy: the same tokens either way


def heavy_tenant_decoding(dev_model, prompts, max_tokens: int):
    """An engine of 32 rows where tenant "a" alone decodes 20 greedy requests, 3 steps in."""
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=32, rank_pools={})
    col = Steps(e)
    for i in range(20):
        e.add_request(f"a{i}", prompts[i], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                      None, col, tenant="a")
    for _ in range(3):
        e.step()
    return e, col


def test_a_newcomers_short_prefill_gets_a_small_step(dev_model, prompts):
    """A prompt of 6 tokens from a second tenant while the first holds 20 decode rows: its step
    decodes none of the first tenant's rows (a prefill step as the newcomer's alone, on the C decode
    step), and the next ones go back to contended_rows, the newcomer's row first."""
    e, col = heavy_tenant_decoding(dev_model, prompts, max_tokens=60)
    arrived = e.scheduler.steps
    e.add_request("v0", prompts[30][:6], SHORT, None, col, tenant="v")
    e.step()
    assert col.first["v0"] == arrived + 1
    small = e.scheduler.small_step_rows
    assert small == (16 if e.executor.decode_step else 0)
    expected = {"v": 1} if small else {"a": e.scheduler.contended_rows, "v": 1}
    assert col.per_step[arrived + 1] == expected
    e.step()
    assert col.per_step[arrived + 2] == {"a": e.scheduler.contended_rows - 1, "v": 1}
    drain(e)
    assert all(len(t) == 60 for r, t in col.tokens.items() if r.startswith("a"))


def test_steps_stay_short_a_while_after_the_light_tenant_leaves(dev_model, prompts):
    """A light tenant's next request most likely comes soon after its last one ended: steps stay
    contended for CONTENDED_LINGER_S after it leaves (on the scheduler's clock), then go whole."""
    e, col = heavy_tenant_decoding(dev_model, prompts, max_tokens=80)
    now = [100.0]
    e.scheduler.clock = lambda: now[0]  # read only once a second tenant has been active
    assert col.per_step[e.scheduler.steps] == {"a": 20}  # alone: whole steps
    e.add_request("v0", prompts[30][:6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), None, col,
                  tenant="v")
    while "v0" not in col.done:
        e.step()
    k = e.scheduler.contended_rows
    e.step()  # the light tenant has gone: still contended
    assert col.per_step[e.scheduler.steps] == {"a": k}
    now[0] += CONTENDED_LINGER_S - 0.1
    e.step()
    assert col.per_step[e.scheduler.steps] == {"a": k}
    now[0] += 0.2  # past the linger: the whole batch again
    e.step()
    assert col.per_step[e.scheduler.steps] == {"a": 20}
    drain(e)


def test_fifo_makes_the_victim_wait_for_the_attacker(attack_runs):
    e, col, arrived = attack_runs["fifo"]
    # first come, first served: the victims wait behind the attacker's 32 queued choices, which wait
    # for 600-token rows to end
    assert all(col.first[f"v{i}"] - arrived >= 590 for i in range(4))
    assert e.stats().preemptions == 0


def test_fair_greedy_outputs_equal_fifo(attack_runs):
    fair, fifo = attack_runs["fair"][1], attack_runs["fifo"][1]
    assert set(fair.tokens) == set(fifo.tokens) and len(fair.tokens) == 68
    for rid in fifo.tokens:
        assert fair.tokens[rid] == fifo.tokens[rid], rid


def run_alone(dev_model, prompts, scheduling: str, tenant):
    """One tenant: 40 requests on 16 rows and a KV cache that cannot hold them (KV preemption), with
    the prefix cache and bursts on one system prompt (deferred admissions)."""
    e = Engine(dev_model, device="cpu", kv_cache_bytes=96 * 16 * PER_TOKEN, max_batch=16, rank_pools={},
               scheduling=scheduling, prefix_cache=True)
    col = Steps(e)
    system = prompts[20][:40]
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for i in range(24):
        e.add_request(f"s{i}", system + prompts[i % 8][-12:], params, None, col, cache_salt=tenant)
    e.step()
    for i in range(24, 40):
        e.add_request(f"s{i}", prompts[i % 16], params, None, col, cache_salt=tenant)
    steps = drain(e) + 1
    return e, col, steps


@pytest.mark.parametrize("tenant", [None, "solo"])
def test_one_tenant_alone_is_served_exactly_as_fifo(dev_model, prompts, tenant):
    fair_e, fair, fair_steps = run_alone(dev_model, prompts, "fair", tenant)
    fifo_e, fifo, fifo_steps = run_alone(dev_model, prompts, "fifo", tenant)
    assert fair_steps == fifo_steps
    a, b = fair_e.stats(), fifo_e.stats()
    assert a.preemptions_kv == b.preemptions_kv > 0 and a.preemptions_share == 0
    assert a.prefix_cache_deferred == b.prefix_cache_deferred > 0
    assert a.prefix_cache_hits == b.prefix_cache_hits
    assert fair.tokens == fifo.tokens and fair.first == fifo.first and fair.done == fifo.done


def test_weights_split_the_rows(dev_model, prompts):
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=16, rank_pools={})
    col = Steps(e)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(20):
        e.add_request(f"a{i}", prompts[i], params, None, col, tenant="heavy", weight=3.0)
        e.add_request(f"b{i}", prompts[i], params, None, col, tenant="light", weight=1.0)
    e.step()
    held = {a.client: a.held for a in e.tenant_stats().active}
    assert held == {"heavy": 12, "light": 4}  # 16 rows split 3:1, from the first step, nothing preempted
    assert e.stats().preemptions == 0
    drain(e)
    assert all(len(t) == 40 for t in col.tokens.values()) and len(col.tokens) == 40


def test_an_equal_tenant_takes_half_the_rows_within_a_step(dev_model, prompts):
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=16, rank_pools={})
    col = Steps(e)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(30):
        e.add_request(f"a{i}", prompts[i % 20], long, None, col, tenant="first")
    e.step()
    for i in range(30):
        e.add_request(f"b{i}", prompts[i % 20], long, None, col, tenant="second")
    e.step()
    held = {a.client: a.held for a in e.tenant_stats().active}
    assert held == {"first": 8, "second": 8}
    assert e.stats().preemptions_share == 8
    for _ in range(20):  # and it stays so: nobody below its share, nobody preempted back
        e.step()
    assert {a.client: a.held for a in e.tenant_stats().active} == {"first": 8, "second": 8}
    assert e.stats().preemptions_share == 8
    for i in range(30):
        e.cancel(f"a{i}")
        e.cancel(f"b{i}")
    assert not e.has_work() and e.stats().kv_cache_usage == 0.0


def test_a_deferred_prefix_block_does_not_block_another_tenant(dev_model, prompts):
    first = {}
    for scheduling in ("fair", "fifo"):
        e = Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=8, rank_pools={}, prefix_cache=True,
                   scheduling=scheduling)
        col = Steps(e)
        shared = (prompts[0] * 3)[:70]  # 4 full blocks
        e.add_request("x1", shared + [5], SHORT, None, col, cache_salt="burst")
        e.add_request("x2", shared + [6], SHORT, None, col, cache_salt="burst")  # waits for x1's blocks
        e.add_request("y1", prompts[1], SHORT, None, col, cache_salt="other")
        drain(e)
        assert e.stats().prefix_cache_deferred >= 1
        first[scheduling] = (col.first["x1"], col.first["x2"], col.first["y1"])
    assert first["fair"] == (1, 2, 1)  # the other tenant is admitted beside x1
    assert first["fifo"] == (1, 2, 2)  # first come, first served: behind the deferred x2


def test_a_full_kv_cache_preempts_the_tenant_over_its_share(dev_model, prompts):
    outs, preempted = {}, {}
    short = [p[:14] for p in prompts[:7]]  # one block each at admission, two after 3 tokens
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for scheduling in ("fair", "fifo"):
        e = Engine(dev_model, device="cpu", kv_cache_bytes=8 * 16 * PER_TOKEN, max_batch=8, rank_pools={},
                   scheduling=scheduling)
        col = Steps(e)
        for i in range(6):
            e.add_request(f"a{i}", short[i], params, None, col, tenant="many")
        e.add_request("b0", short[6], params, None, col, tenant="one")  # the youngest request
        drain(e)
        rep = e.tenant_stats()
        preempted[scheduling] = (rep.named["many"].preempted["kv"], rep.named["one"].preempted["kv"])
        outs[scheduling] = col.tokens
    assert preempted["fair"][0] > 0 and preempted["fair"][1] == 0  # the tenant over its share gives way
    assert preempted["fifo"][1] > 0  # fifo: the youngest request, whoever's
    assert outs["fair"] == outs["fifo"] and all(len(t) == 40 for t in outs["fair"].values())


def test_tenant_and_weight_arguments(dev_model, prompts, tok_engine):
    from handler.engine.engine import InvalidRequestError

    e = tok_engine
    for bad in (0, -1, float("nan"), float("inf"), "heavy"):
        with pytest.raises(InvalidRequestError):
            e.add_request("w", prompts[0], SHORT, None, None, tenant="t", weight=bad)
    assert not e.has_work()
    e.add_request("s1", prompts[0], SHORT, None, None, cache_salt="salted")  # tenant defaults to the salt
    e.add_request("s2", prompts[1], SHORT, None, None, cache_salt="salted", tenant="billing")
    assert {r.tenant for r in e._waiting} == {"salted", "billing"}  # noqa: SLF001
    assert {a.client for a in e.tenant_stats().active} == {"salted", "billing"}
    drain(e)
    assert e.tenant_stats().active == [] and e.stats().scheduling == "fair"


def test_parked_rows_give_their_cache_back_when_it_runs_short(dev_model, prompts):
    """Rows parked for another tenant's share keep their KV blocks only while the cache has room: a
    newcomer that lacks blocks takes theirs first (they are recomputed later), and every answer is
    still the greedy one fifo gives."""
    short = [p[:14] for p in prompts[:12]]  # one block each at admission
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = {}
    for scheduling in ("fair", "fifo"):
        e = Engine(dev_model, device="cpu", kv_cache_bytes=34 * 16 * PER_TOKEN, max_batch=8, rank_pools={},
                   scheduling=scheduling)
        col = Steps(e)
        count = PrefillCount(e)
        for i in range(8):
            e.add_request(f"a{i}", short[i], params, None, col, tenant="many")
        for _ in range(12):  # 8 rows of 2 blocks each (16 of 34); each needs 4 at its end (54 tokens)
            e.step()
        for i in range(4):
            e.add_request(f"b{i}", short[8 + i], params, None, col, tenant="one")
        drain(e)
        outs[scheduling] = col.tokens
        if scheduling == "fair":
            st = e.stats()
            # 4 of the 8 rows parked for the newcomer's share, holding 8 blocks; the 8 running rows
            # grow to 32 blocks: the parked rows' blocks go first (recomputed later: more prompt
            # tokens than the prompts), no running row is preempted
            assert st.preemptions_share == 4 and st.preemptions_kv == 0
            assert count.tokens > sum(len(p) for p in short)
            assert {r for r in col.first if r.startswith("b")} == {f"b{i}" for i in range(4)}
    assert outs["fair"] == outs["fifo"] and all(len(t) == 40 for t in outs["fair"].values())


def test_steps_stay_whole_while_every_tenant_holds_its_share(dev_model, prompts):
    """Two heavy tenants, each with more requests than its 8 rows: nobody is below its share, so every
    step decodes all 16 rows (short steps protect a light tenant only)."""
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=16, rank_pools={})
    col = Steps(e)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(12):
        e.add_request(f"a{i}", prompts[i], long, None, col, tenant="first")
        e.add_request(f"b{i}", prompts[i + 12], long, None, col, tenant="second")
    for _ in range(3):
        e.step()
    assert {a.client: a.held for a in e.tenant_stats().active} == {"first": 8, "second": 8}
    start = e.scheduler.steps
    for _ in range(10):
        e.step()
    for step in range(start + 1, start + 11):
        assert col.per_step[step] == {"a": 8, "b": 8}, step
    drain(e)
