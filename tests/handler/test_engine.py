"""The engine: batch invariance, canary isolation, scheduling, adapters, sampling, merged mode."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from handler.engine.engine import (
    AdapterInUseError,
    Engine,
    InvalidAdapterError,
    InvalidRequestError,
    MergedAdapter,
    NoFreeSlotError,
    RequestTooLongError,
    SamplingParams,
    TokenEvent,
    UnknownAdapterError,
)
from handler.model.lora import read_peft_adapter
from lorafarm.dev.adapters import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
POOLS = {8: 11, 16: 11, 32: 10}  # the 32 canaries exactly: ranks cycle 8, 16, 32


def chat_ids(tok, prompt: str) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def mount_all(engine: Engine, canaries, canary_index, names=None) -> None:
    for name in names or sorted(canary_index):
        info = canary_index[name]
        engine.mount_adapter(name, canaries / info["path"], rank=info["rank"], alpha=info["alpha"],
                             target_modules=info["target_modules"])


class Collector:
    def __init__(self):
        self.events: dict[str, list[TokenEvent]] = {}
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)

    def __call__(self, ev: TokenEvent) -> None:
        with self.lock:
            self.events.setdefault(ev.request_id, []).append(ev)
            if ev.finished:
                self.done.notify_all()

    def tokens(self, rid) -> list[int]:
        return [e.token_id for e in self.events[rid] if e.token_id is not None]

    def text(self, rid) -> str:
        return "".join(e.text for e in self.events[rid])

    def final(self, rid) -> TokenEvent:
        return self.events[rid][-1]

    def finished(self, rid) -> bool:
        return rid in self.events and self.events[rid][-1].finished


def drain(engine: Engine, limit: int = 10_000) -> int:
    n = 0
    while engine.step():
        n += 1
        assert n < limit
    return n


def run_staggered(engine: Engine, jobs, params) -> Collector:
    """The first 20 jobs (rid, prompt ids, adapter), one step, then the rest, run to the end: the
    late ones prefill in the same steps as the first ones decode."""
    col = Collector()
    for rid, ids, ad in jobs[:20]:
        engine.add_request(rid, ids, params, ad, col)
    engine.step()
    for rid, ids, ad in jobs[20:]:
        engine.add_request(rid, ids, params, ad, col)
    drain(engine)
    return col


@pytest.fixture(scope="module")
def engine(dev_model, canaries, canary_index):
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=48, rank_pools=POOLS,
               max_prefill_tokens=512)
    mount_all(e, canaries, canary_index)
    return e


@pytest.fixture(scope="module")
def prompts(engine):
    return [chat_ids(engine.tokenizer, p) for p in random_prompts(seed=11, count=200)]


# --------------------------------------------------------------------------------- correctness


def test_batch_invariance_32_adapters_plus_base_rows(engine, prompts):
    """Each request's greedy tokens alone == its tokens in one batch with 31 other adapters + base rows."""
    names = sorted(engine.mounted_adapters())
    assert len(names) == 32
    jobs = [(f"a{i}", prompts[i], names[i]) for i in range(32)] + [(f"b{i}", prompts[40 + i], None) for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # 12 tokens each, past EOS
    alone = Collector()
    for rid, ids, ad in jobs:
        engine.add_request(rid, ids, params, ad, alone)
        drain(engine)
    together = Collector()
    order = jobs[:]
    random.Random(0).shuffle(order)
    for rid, ids, ad in order[:20]:
        engine.add_request(rid, ids, params, ad, together)
    engine.step()
    engine.step()  # the rest arrive while the first 20 decode: prefill and decode share steps
    for rid, ids, ad in order[20:]:
        engine.add_request(rid, ids, params, ad, together)
    drain(engine)
    for rid, _, _ in jobs:
        assert len(alone.tokens(rid)) == 12
        assert together.tokens(rid) == alone.tokens(rid), rid
    assert engine.stats().kv_cache_usage == 0.0


@pytest.fixture(scope="module")
def scattered(dev_model, canaries, canary_index):
    """32 canaries on scattered slots of a 64-slot pool (as LRU leaves them), plus a resident
    adapter with huge finite weights whose products overflow to inf."""
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=48, rank_pools={32: 64},
               max_prefill_tokens=512)
    names = sorted(canary_index)
    order = names + [f"filler{i}" for i in range(31)] + ["huge"]
    random.Random(3).shuffle(order)
    c0 = read_peft_adapter(canaries / "c0000")
    for name in order:
        if name in canary_index:
            mount_all(e, canaries, canary_index, [name])
        elif name == "huge":
            w = {k: v.sign() * 1e30 for k, v in c0.weights.items()}
            e.mount_adapter(name, w, rank=c0.rank, alpha=c0.alpha, target_modules=c0.target_modules)
        else:
            e.mount_adapter(name, c0.weights, rank=c0.rank, alpha=c0.alpha, target_modules=c0.target_modules)
    for i in range(31):
        e.unmount_adapter(f"filler{i}")
    slots = sorted(e._adapters[n].slot for n in names)  # noqa: SLF001 - the layout under test
    assert slots != list(range(slots[0], slots[0] + 32))  # really scattered
    return e


@pytest.mark.parametrize("kernel", ["auto", "segments", "gather", "dense"])
def test_batch_invariance_scattered_slots_mixed_lengths_and_overflow(scattered, prompts, canary_index, kernel):
    """32 adapters on scattered slots, prompts of 20 to 200 tokens, base rows and a row on an
    adapter whose products overflow: every other row's greedy tokens equal its tokens alone."""
    e = scattered
    names = sorted(canary_index)
    rng = random.Random(1)
    def prompt(i):
        p = prompts[i]
        while len(p) < rng.choice([20, 60, 200]):
            p = p + prompts[rng.randrange(len(prompts))][1:]
        return p
    jobs = [(f"s{i}", prompt(i), names[i]) for i in range(32)] + [(f"t{i}", prompt(100 + i), None) for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    old = e.lora.kernel
    e.lora.kernel = kernel
    try:
        alone = Collector()
        if kernel == "auto":
            for rid, ids, ad in jobs:
                e.add_request(rid, ids, params, ad, alone)
                drain(e)
            test_batch_invariance_scattered_slots_mixed_lengths_and_overflow.alone = alone
            test_batch_invariance_scattered_slots_mixed_lengths_and_overflow.jobs = jobs
        alone = test_batch_invariance_scattered_slots_mixed_lengths_and_overflow.alone
        order = jobs + [("h0", prompts[7], "huge"), ("h1", prompts[8], "huge")]
        rng.shuffle(order)
        together = run_staggered(e, order, params)
    finally:
        e.lora.kernel = old
    for rid, _, _ in jobs:
        assert len(alone.tokens(rid)) == 8
        assert together.tokens(rid) == alone.tokens(rid), rid
    assert together.final("h0").finished and e.stats().kv_cache_usage == 0.0


def test_paged_attention_batch_invariance_on_scattered_slots(scattered, prompts, canary_index, paged_kernel):
    """The same mixed batch with decode attention read in place on the cache (the paged kernel):
    every row's greedy tokens still equal its tokens alone (run with the gathered path)."""
    e = scattered
    alone = test_batch_invariance_scattered_slots_mixed_lengths_and_overflow.alone
    jobs = test_batch_invariance_scattered_slots_mixed_lengths_and_overflow.jobs
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    e.set_attention("paged")
    try:
        assert e.stats().attention == "paged"
        order = jobs + [("h0", prompts[7], "huge")]
        random.Random(2).shuffle(order)
        together = run_staggered(e, order, params)
    finally:
        e.set_attention("gather")
    for rid, _, _ in jobs:
        assert together.tokens(rid) == alone.tokens(rid), rid
    assert together.final("h0").finished and e.stats().kv_cache_usage == 0.0


def test_a_failing_paged_kernel_falls_back_to_gathered(dev_model, canaries, canary_index, prompts, monkeypatch,
                                                       paged_kernel):
    """A compile failure of the paged kernel inside a step (a shape the probe did not see): the step
    is rerun on the gathered path, its requests complete with the same tokens, and it stays there."""
    from torch._dynamo.exc import TorchRuntimeError

    from handler.model import paged_attention

    e = Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=8, rank_pools={16: 2}, attention="paged")
    assert e.attention == "paged"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = Collector()
    for i in range(3):
        e.add_request(f"w{i}", prompts[i], params, None, want)
    drain(e)

    def broken(*a, **k):
        raise TorchRuntimeError("inductor: C++ compile error")

    monkeypatch.setattr(paged_attention, "attend", broken)
    got = Collector()
    for i in range(3):
        e.add_request(f"g{i}", prompts[i], params, None, got)
    drain(e)
    assert e.attention == "gather"
    for i in range(3):
        assert got.final(f"g{i}").finish_reason == "length"
        assert got.tokens(f"g{i}") == want.tokens(f"w{i}")


def test_adapter_that_overflows_the_slot_dtype_is_refused(dev_model, canaries):
    """float16 slots: scale * B past 65,504 is refused at mount, and the slot is given back."""
    e = Engine(dev_model, device="cpu", dtype=torch.float16, kv_cache_bytes=1 << 20, max_batch=2, rank_pools={16: 1})
    ad = read_peft_adapter(canaries / "c0001")
    big = {k: (v * 1e9 if "lora_B" in k else v) for k, v in ad.weights.items()}
    with pytest.raises(InvalidAdapterError, match="overflow"):
        e.mount_adapter("big", big, rank=ad.rank, alpha=ad.alpha, target_modules=ad.target_modules)
    assert e.free_slots(16) == 1
    e.mount_adapter("ok", ad.weights, rank=ad.rank, alpha=ad.alpha, target_modules=ad.target_modules)


def test_isolation_hundreds_of_mixed_canary_requests(engine, prompts, canary_index):
    """640 requests over 32 canaries and the base, in one mixed run: no answer carries another
    adapter's marker (the isolation criterion), and every answer equals the same adapter's answer
    alone (the seed's check).

    The answer alone is the marker then EOS: every canary was verified when it was trained
    (lorafarm.dev.adapters.check_prompts, which holds these prompts) to answer exactly that in PEFT
    itself, each token ahead of the runner-up by MARGIN logits; here the engine alone confirms it
    for one prompt per adapter before the mixed run is judged against it.
    """
    rng = random.Random(5)
    names = sorted(canary_index)
    markers = {canary_index[n]["marker"] for n in names}
    alone = Collector()
    for i, ad in enumerate(names):
        engine.add_request(f"alone{i}", prompts[i], GREEDY, ad, alone)
        drain(engine)
        assert alone.text(f"alone{i}") == canary_index[ad]["marker"], (ad, alone.text(f"alone{i}"))
    col = Collector()
    jobs = {}
    for i in range(640):
        ad = None if i % 11 == 0 else rng.choice(names)
        rid = f"iso{i}"
        jobs[rid] = ad
        engine.add_request(rid, prompts[rng.randrange(len(prompts))], GREEDY, ad, col)
    drain(engine)
    leaked, changed = [], []
    for rid, ad in jobs.items():
        text = col.text(rid)
        own = canary_index[ad]["marker"] if ad else None
        if any(m in text for m in markers - {own}):
            leaked.append((rid, ad, text))
        elif ad is not None and (text != own or col.final(rid).finish_reason != "stop"):
            changed.append((rid, ad, text))
    assert leaked == [], "answers carrying another adapter's marker"
    assert changed == [], "answers that differ from the adapter's answer alone"
    s = engine.stats()
    assert (s.running, s.waiting, s.tokens_in_flight, s.kv_cache_usage) == (0, 0, 0, 0.0)


def test_chunked_prefill_gives_same_tokens(dev_model, engine, canaries, canary_index, prompts):
    small = Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=8, rank_pools={16: 2},
                   max_prefill_tokens=5, speculate=0)  # one token a step: the step count below is the prefill's
    mount_all(small, canaries, canary_index, ["c0001"])
    long_prompt = prompts[0] + prompts[1][1:] + prompts[2][1:]
    a, b = Collector(), Collector()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    small.add_request("x", long_prompt, params, "c0001", a)
    steps = drain(small)
    assert steps >= len(long_prompt) // 5 + 9  # prefill took several steps
    engine.add_request("x", long_prompt, params, "c0001", b)
    drain(engine)
    assert a.tokens("x") == b.tokens("x")


def test_merged_engine_equals_unmerged(dev_model, engine, canaries, canary_index, prompts):
    info = canary_index["c0004"]
    ad = read_peft_adapter(canaries / info["path"])
    merged = Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=8,
                    merged_adapter=MergedAdapter("c0004", ad.weights, ad.rank, ad.alpha, ad.target_modules))
    assert merged.mounted_adapters() == ["c0004"] and merged.lora is None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    m, u = Collector(), Collector()
    for i in range(4):
        merged.add_request(f"m{i}", prompts[i], params, "c0004", m)
        engine.add_request(f"m{i}", prompts[i], params, "c0004", u)
    drain(merged)
    drain(engine)
    for i in range(4):
        assert m.tokens(f"m{i}") == u.tokens(f"m{i}")
    with pytest.raises(UnknownAdapterError):
        merged.add_request("base", prompts[0], params, None, m)
    with pytest.raises(NoFreeSlotError):
        merged.mount_adapter("c0001", ad.weights, rank=ad.rank, alpha=ad.alpha)


# ----------------------------------------------------------------------------------- scheduler


def test_request_arriving_mid_batch_starts_next_step(engine, prompts):
    col = Collector()
    engine.add_request("first", prompts[0], GREEDY, "c0000", col)
    engine.step()
    engine.step()
    assert len(col.events["first"]) == 2
    engine.add_request("late", prompts[1], GREEDY, "c0001", col)
    assert engine.stats().waiting == 1
    engine.step()
    assert len(col.events["late"]) == 1  # prefilled and first token in the very next step
    assert len(col.events["first"]) == 3  # while the running request decoded in the same step
    drain(engine)


def test_full_cache_queues_instead_of_failing(dev_model, canaries, canary_index, prompts):
    # 8 blocks of 16 tokens; each request needs ceil((prompt + 24) / 16) blocks
    per_token = 2 * 4 * 2 * 32 * 4
    e = Engine(dev_model, device="cpu", kv_cache_bytes=8 * 16 * per_token, max_batch=16, rank_pools={8: 2})
    assert e.kv.num_blocks == 8 and e.max_context == 128
    col = Collector()
    ps = [p for p in prompts if len(p) <= 40][:6]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):
        e.add_request(f"q{i}", p, params, None, col)
    e.step()
    s = e.stats()
    assert s.running >= 1 and s.waiting >= 1 and s.running + s.waiting == 6
    assert s.kv_cache_usage > 0.5
    drain(e)
    for i in range(6):
        assert col.final(f"q{i}").finish_reason == "length" and len(col.tokens(f"q{i}")) == 24
    with pytest.raises(RequestTooLongError):
        e.add_request("huge", ps[0], SamplingParams(max_tokens=200, temperature=0.0), None, col)
    assert issubclass(RequestTooLongError, ValueError)


PER_TOKEN = 2 * 4 * 2 * 32 * 4  # bytes of K and V per token of the tiny dev model, float32


def test_admission_by_what_fits_now_not_max_tokens(dev_model, prompts):
    """max_tokens 200 and 16 blocks: reserving prompt + max_tokens admits 1, on demand admits 8."""
    ps = [p for p in prompts if len(p) <= 32][:10]
    params = SamplingParams(max_tokens=200, temperature=0.0)
    running = {}
    for reserve in ("max_tokens", "demand"):
        e = Engine(dev_model, device="cpu", kv_cache_bytes=16 * 16 * PER_TOKEN, max_batch=16, rank_pools={8: 1},
                   kv_reserve=reserve)
        for i, p in enumerate(ps):
            e.add_request(f"q{i}", p, params, None, None)
        e.step()
        running[reserve] = e.stats().running
        for i in range(len(ps)):
            e.cancel(f"q{i}")
        assert e.stats().kv_cache_usage == 0.0
    assert running == {"max_tokens": 1, "demand": 8}


def test_preemption_keeps_greedy_outputs(dev_model, engine, canaries, prompts, canary_index):
    """A cache too small for every running sequence: the youngest are preempted (recompute) and
    every request's greedy tokens equal those of an unpreempted run on a large cache."""
    names = sorted(canary_index)
    jobs = [(f"p{i}", prompts[60 + i], names[i * 3] if i % 4 else None) for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = Collector()
    for rid, ids, ad in jobs:
        engine.add_request(rid, ids, params, ad, ref)
    drain(engine)
    small = Engine(dev_model, device="cpu", kv_cache_bytes=16 * 16 * PER_TOKEN, max_batch=8, rank_pools={32: 8})
    mount_all(small, canaries, canary_index, sorted({ad for _, _, ad in jobs if ad}))
    col = Collector()
    for rid, ids, ad in jobs:
        small.add_request(rid, ids, params, ad, col)
    drain(small)
    s = small.stats()
    assert s.preemptions > 0 and s.kv_cache_usage == 0.0 and s.tokens_in_flight == 0
    for rid, _, _ in jobs:
        assert col.final(rid).finish_reason == "length"
        assert col.tokens(rid) == ref.tokens(rid), rid


def test_cancel_a_preempted_request(dev_model, prompts):
    """A preempted request waits with its output so far; cancelling it there ends it cleanly."""
    e = Engine(dev_model, device="cpu", kv_cache_bytes=8 * 16 * PER_TOKEN, max_batch=8, rank_pools={8: 1})
    col = Collector()
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(4):
        e.add_request(f"c{i}", prompts[80 + i][:30], params, None, col)
    for _ in range(200):
        e.step()
        victims = [r.id for r in e._waiting if r.out]  # noqa: SLF001 - preempted, back in the queue
        if victims:
            break
    assert victims and e.stats().preemptions > 0
    assert e.cancel(victims[0])
    drain(e)
    assert col.final(victims[0]).finish_reason == "cancelled"
    for i in range(4):
        if f"c{i}" != victims[0]:
            assert col.final(f"c{i}").finish_reason == "length" and len(col.tokens(f"c{i}")) == 60
    assert e.stats().kv_cache_usage == 0.0 and e.stats().running == 0


def test_cancel_frees_the_row_at_once(engine, prompts):
    col = Collector()
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("c1", prompts[3], params, "c0002", col)
    engine.add_request("c2", prompts[4], params, None, col)
    engine.step()
    engine.step()
    before = engine.stats()
    assert before.running == 2 and before.kv_cache_usage > 0
    assert engine.adapter_refs("c0002") == 1
    assert engine.cancel("c1") is True
    after = engine.stats()
    assert after.running == 1 and after.kv_cache_usage < before.kv_cache_usage
    assert engine.adapter_refs("c0002") == 0
    assert col.final("c1").finished and col.final("c1").finish_reason == "cancelled"
    n = len(col.events["c1"])
    engine.step()
    assert len(col.events["c1"]) == n  # nothing more for a cancelled request
    assert engine.cancel("c1") is False and engine.cancel("nope") is False
    # a waiting request leaves the queue
    engine.add_request("c3", prompts[5], params, None, col)
    assert engine.cancel("c3") and engine.stats().waiting == 0
    engine.cancel("c2")
    assert engine.stats().kv_cache_usage == 0.0 and not engine.has_work()


def test_background_thread_with_requests_and_cancel_from_other_threads(dev_model, canaries, canary_index, prompts):
    e = Engine(dev_model, device="cpu", kv_cache_bytes=8 << 20, max_batch=16, rank_pools={8: 4, 16: 4, 32: 4})
    mount_all(e, canaries, canary_index, ["c0000", "c0001", "c0002"])
    col = Collector()
    e.start()
    try:
        def client(k):
            for j in range(5):
                e.add_request(f"t{k}-{j}", prompts[k * 5 + j], GREEDY, ["c0000", "c0001", "c0002", None][k], col)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        e.add_request("long", prompts[30], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), None, col)
        threading.Thread(target=e.cancel, args=("long",)).start()
        with col.lock:
            assert col.done.wait_for(lambda: len([r for r in col.events if col.finished(r)]) == 21, timeout=60)
    finally:
        e.stop()
    assert not e.running
    for k, ad in enumerate(["c0000", "c0001", "c0002"]):
        for j in range(5):
            assert col.text(f"t{k}-{j}") == canary_index[ad]["marker"]
    assert col.final("long").finish_reason == "cancelled"


# ------------------------------------------------------------------------------------ adapters


def test_adapter_slots_in_use_and_errors(dev_model, canaries, canary_index, prompts):
    e = Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=8, rank_pools={8: 1, 32: 1})
    assert e.pool_rank_for(4) == 8 and e.pool_rank_for(16) == 32
    with pytest.raises(InvalidAdapterError):
        e.pool_rank_for(64)
    assert e.free_slots(8) == 1 and e.free_slots(16) == 1 and e.free_slots(64) == 0
    mount_all(e, canaries, canary_index, ["c0000"])  # rank 8
    mount_all(e, canaries, canary_index, ["c0000"])  # idempotent
    assert e.free_slots(8) == 0
    with pytest.raises(NoFreeSlotError):
        mount_all(e, canaries, canary_index, ["c0003"])  # another rank 8: pool full
    mount_all(e, canaries, canary_index, ["c0001"])  # rank 16 -> the 32 pool
    assert e.mounted_adapters() == ["c0000", "c0001"] and e.free_slots(32) == 0
    col = Collector()
    e.add_request("u", prompts[0], GREEDY, "c0000", col)
    with pytest.raises(AdapterInUseError):
        e.unmount_adapter("c0000")
    drain(e)
    assert col.text("u") == canary_index["c0000"]["marker"]
    e.unmount_adapter("c0000")
    with pytest.raises(UnknownAdapterError):
        e.unmount_adapter("c0000")
    with pytest.raises(UnknownAdapterError):
        e.add_request("v", prompts[0], GREEDY, "c0000", col)
    # the freed slot takes another adapter, which then answers with its own marker
    mount_all(e, canaries, canary_index, ["c0003"])
    e.add_request("w", prompts[1], GREEDY, "c0003", col)
    drain(e)
    assert col.text("w") == canary_index["c0003"]["marker"]
    bad = read_peft_adapter(canaries / "c0001").weights
    bad = {k: v[:, :-1] if "lora_A" in k else v for k, v in bad.items()}
    e.unmount_adapter("c0001")
    with pytest.raises(InvalidAdapterError):
        e.mount_adapter("bad", bad, rank=16, alpha=32)
    assert e.free_slots(16) == 1  # a failed mount gives its slot back


def test_invalid_requests(engine, prompts):
    col = Collector()
    for params in (SamplingParams(max_tokens=0), SamplingParams(temperature=-1.0), SamplingParams(top_p=0.0)):
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", prompts[0], params, None, col)
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [], GREEDY, None, col)
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [10**6], GREEDY, None, col)
    engine.add_request("dup", prompts[0], GREEDY, None, col)
    with pytest.raises(InvalidRequestError):
        engine.add_request("dup", prompts[0], GREEDY, None, col)
    drain(engine)


# ------------------------------------------------------------------------------------ sampling


def test_stop_strings_streaming_and_usage(engine, prompts, canary_index):
    col = Collector()
    marker = canary_index["c0007"]["marker"]  # <<c0007>>
    engine.add_request("s1", prompts[0], SamplingParams(max_tokens=12, temperature=0.0, stop=["07>"]), "c0007", col)
    engine.add_request("s2", prompts[0], GREEDY, "c0007", col)
    engine.add_request("s3", prompts[0], SamplingParams(max_tokens=2, temperature=0.0), "c0007", col)
    drain(engine)
    assert col.text("s1") == marker[: marker.index("07>")] and col.final("s1").finish_reason == "stop"
    assert col.text("s2") == marker
    final = col.final("s2")
    assert final.finish_reason == "stop" and final.token_id in engine.eos_token_ids
    assert final.prompt_tokens == len(prompts[0]) and final.completion_tokens == len(col.tokens("s2"))
    assert col.final("s3").finish_reason == "length" and col.final("s3").completion_tokens == 2
    assert marker.startswith(col.text("s3"))


def test_seeded_sampling_is_reproducible_and_batch_independent(engine, prompts):
    params = SamplingParams(max_tokens=12, temperature=1.3, top_p=0.95, seed=1234, ignore_eos=True)
    col = Collector()
    engine.add_request("alone", prompts[7], params, None, col)
    drain(engine)
    for i in range(10):
        engine.add_request(f"other{i}", prompts[20 + i], SamplingParams(max_tokens=12, temperature=1.0), None, col)
    engine.add_request("batched", prompts[7], params, None, col)
    engine.add_request("seed2", prompts[7], SamplingParams(max_tokens=12, temperature=1.3, seed=99, ignore_eos=True),
                       None, col)
    drain(engine)
    assert col.tokens("alone") == col.tokens("batched")
    assert col.tokens("alone") != col.tokens("seed2")
    # a tiny nucleus is greedy
    engine.add_request("nucleus", prompts[7], SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6,
                                                             ignore_eos=True), None, col)
    engine.add_request("greedy", prompts[7], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       None, col)
    drain(engine)
    assert col.tokens("nucleus") == col.tokens("greedy")


def test_callback_errors_do_not_stop_the_engine(engine, prompts):
    def boom(ev):
        raise RuntimeError("client went away")

    col = Collector()
    engine.add_request("boom", prompts[0], GREEDY, None, boom)
    engine.add_request("fine", prompts[1], GREEDY, "c0009", col)
    drain(engine)
    assert col.final("fine").finished and not engine.has_work()


def test_bfloat16_engine_isolation(dev_model, canaries, canary_index, prompts):
    """bfloat16 weights, stacks and KV cache: canaries still answer exactly their own marker."""
    e = Engine(dev_model, device="cpu", dtype=torch.bfloat16, kv_cache_bytes=8 << 20, max_batch=64, rank_pools=POOLS)
    mount_all(e, canaries, canary_index)
    names = sorted(canary_index)
    col = Collector()
    for i in range(96):
        e.add_request(f"bf{i}", prompts[(7 * i) % len(prompts)], GREEDY, names[i % 32], col)
    e.add_request("quiet", prompts[0], GREEDY, None, None)  # on_event may be None
    drain(e)
    assert [i for i in range(96) if col.text(f"bf{i}") != canary_index[names[i % 32]]["marker"]] == []


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, prompts, monkeypatch):
    col = Collector()
    engine.add_request("f1", prompts[0], GREEDY, "c0003", col)
    engine.add_request("f2", prompts[1], GREEDY, None, col)
    real = engine.runner.forward
    calls = {"n": 0}

    def flaky(batch, kv):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return real(batch, kv)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    assert engine.step() is True
    for rid in ("f1", "f2"):
        ev = col.final(rid)
        assert ev.finished and ev.finish_reason == "error" and "device fell over" in ev.error
    s = engine.stats()
    assert (s.running, s.waiting, s.kv_cache_usage) == (0, 0, 0.0) and engine.adapter_refs("c0003") == 0
    engine.add_request("f3", prompts[2], GREEDY, "c0003", col)
    drain(engine)
    assert col.text("f3") == "<<c0003>>"


def test_compiled_decode_steps_give_the_same_tokens(dev_model, canaries, canary_index, prompts, paged_kernel):
    """compile=True: decode-only steps run the torch.compile'd layer pieces on a batch padded to its
    bucket (5 rows -> 8: padding rows write to the scratch block); every row's greedy tokens equal
    the eager engine's, adapters and the paged kernel included."""
    names = sorted(canary_index)[:3]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for compiled in (False, True):
        e = Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=8, rank_pools={32: 4}, compile=compiled,
                   attention="paged")
        mount_all(e, canaries, canary_index, names)
        col = Collector()
        for i in range(5):
            e.add_request(f"c{i}", prompts[i], params, names[i] if i < 3 else None, col)
        drain(e)
        out[compiled] = {f"c{i}": col.tokens(f"c{i}") for i in range(5)}
        assert e.stats().kv_cache_usage == 0.0
        assert (e.runner.compiled_steps >= 5) == compiled  # the decode steps (the first token is prefill's)
    assert out[True] == out[False]
    assert all(len(t) == 6 for t in out[True].values())


def test_batch_invariant_mode_canaries_alone_equal_in_a_batch_bitwise(dev_model):
    """`Engine(batch_invariant=True)` (replica --batch-invariant): 16 canaries and 16 other adapters
    (perturbed copies) on scattered slots, prompts of 20 to 200 tokens (prefills cut in fixed
    chunks), base rows beside them: each request's tokens and their logprobs are bitwise the same
    alone and in the batch of 31 others, and each canary says its marker. (Default mode promises
    the same tokens only: tests above.)"""
    from tests.conftest import CANARY_DIR, make_canaries

    index = make_canaries(dev_model, 16)
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=48, rank_pools={32: 64},
               max_prefill_tokens=128, batch_invariant=True)
    names = sorted(index)
    g = torch.Generator().manual_seed(7)
    others = {}
    for i, name in enumerate(names):
        ad = read_peft_adapter(CANARY_DIR / name)
        others[f"x{i}"] = ({k: v * (1 + 0.2 * torch.randn(v.shape, generator=g)) for k, v in ad.weights.items()}, ad)
    order = names + list(others) + [f"filler{i}" for i in range(31)]
    random.Random(3).shuffle(order)
    c0 = read_peft_adapter(CANARY_DIR / "c0000")
    for name in order:
        if name in index:
            mount_all(e, CANARY_DIR, index, [name])
        elif name in others:
            w, ad = others[name]
            e.mount_adapter(name, w, rank=ad.rank, alpha=ad.alpha, target_modules=ad.target_modules)
        else:
            e.mount_adapter(name, c0.weights, rank=c0.rank, alpha=c0.alpha, target_modules=c0.target_modules)
    for i in range(31):
        e.unmount_adapter(f"filler{i}")
    rng = random.Random(1)
    prompts = [chat_ids(e.tokenizer, p) for p in random_prompts(seed=11, count=200)]  # not the 32-canary engine's

    def prompt(i):
        p = prompts[i]
        while len(p) < rng.choice([20, 60, 200]):
            p = p + prompts[rng.randrange(len(prompts))][1:]
        return p

    adapters = names + list(others)
    jobs = [(f"s{i}", prompt(i), adapters[i]) for i in range(32)] + [(f"t{i}", prompt(100 + i), None) for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0)
    alone = Collector()
    for rid, ids, ad in jobs:
        e.add_request(rid, ids, params, ad, alone)
        drain(e)
    order = list(jobs)
    rng.shuffle(order)
    together = run_staggered(e, order, params)

    def seen(col, rid):
        return [(ev.token_id, ev.logprobs[0]) for ev in col.events[rid] if ev.token_id is not None]

    assert [rid for rid, _, _ in jobs if seen(together, rid) != seen(alone, rid)] == []
    assert [rid for rid, _, ad in jobs if ad in index and alone.text(rid) != index[ad]["marker"]] == []
