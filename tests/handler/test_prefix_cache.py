"""The prefix cache: the block pool's reference counting and LRU (pure), chain hashes keyed by base,
adapter and tenant, and the engine reusing cached blocks with the same outputs as without them."""

from __future__ import annotations

import pytest
import torch

from handler.engine.engine import Engine, SamplingParams
from handler.model.prefix_cache import BlockPool, chain_hashes, chain_root
from lorafarm.dev.adapters import random_prompts
from tests.handler.test_engine import Collector

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PER_TOKEN = 2 * 4 * 2 * 32 * 4  # bytes of K and V per token of the tiny dev model, float32
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


# ------------------------------------------------------------------------------------ the pool


def test_pool_frees_unpublished_and_caches_published_blocks():
    p = BlockPool(4)
    a, recycled = p.take(3)
    assert a == [0, 1, 2] and recycled == [] and p.available == 1
    assert p.publish(a[0], b"h0") and p.publish(a[1], b"h1")
    assert p.release(a) == [2]  # only the unpublished block is freed (to be zeroed)
    assert p.available == 4 and p.cached == 2 and p.in_use == 0
    assert p.match([b"h0", b"h1", b"h2"]) == [0, 1]  # the longest cached prefix
    assert p.refs[0] == p.refs[1] == 1 and p.available == 2
    assert p.match([b"h1"]) == [1]  # a chain is matched by its hashes, whatever the first block
    assert p.refs[1] == 2


def test_pool_evicts_least_recently_released_and_never_a_referenced_block():
    p = BlockPool(4)
    blocks, _ = p.take(4)
    for i, b in enumerate(blocks):
        p.publish(b, bytes([i]))
    held = p.match([bytes([0])])  # block 0: referenced twice now
    p.release([3, 1, 2])  # LRU order: 3, 1, 2 (block 0 still held)
    got, recycled = p.take(2)
    assert got == [3, 1] and recycled == [3, 1] and p.evictions == 2
    assert p.match([bytes([3])]) == [] and p.match([bytes([1])]) == []  # forgotten with their blocks
    assert p.take(2) is None  # block 2 is evictable, block 0 is referenced: only one available
    assert p.refs[0] == 2 and p.match([bytes([0])]) == [0]
    p.release(held + [0, 0])
    assert p.available == 2 and p.refs[0] == 0


def test_pool_rules():
    p = BlockPool(3)
    a, _ = p.take(2)
    assert p.publish(a[0], b"x") and not p.publish(a[1], b"x")  # one block per hash: the first keeps it
    assert not p.publish(a[0], b"y")  # a block has one name
    assert p.match([b"x", b"q"], multiple=2) == []  # only whole multiples of `multiple` blocks
    p.release(a)
    with pytest.raises(RuntimeError):
        p.release([a[1]])  # released more often than taken
    with pytest.raises(RuntimeError):
        p.publish(2, b"z")  # a free block cannot be named
    off = BlockPool(2, caching=False)
    b, _ = off.take(1)
    assert not off.publish(b[0], b"x") and off.release(b) == b and off.cached == 0


def test_pool_head_match_takes_the_sibling_with_the_longest_common_first_tokens():
    p = BlockPool(6)
    blocks, _ = p.take(5)
    kids = {(1, 2, 3, 4): blocks[0], (1, 2, 7, 7): blocks[1], (1, 5, 0, 0): blocks[2], (9, 9, 9, 9): blocks[3]}
    for i, (toks, b) in enumerate(kids.items()):
        assert p.publish(b, bytes([i]), b"parent", toks)
    assert p.publish(blocks[4], b"other", b"elsewhere", (1, 2, 3, 4))
    assert p.match_head(b"parent", [1, 2, 3, 8]) == (blocks[0], 3)
    assert p.match_head(b"parent", [1, 2, 7]) == (blocks[1], 3)  # at most the tokens asked for
    one = p.match_head(b"parent", [1, 3])
    assert one in ((blocks[0], 1), (blocks[1], 1), (blocks[2], 1))
    assert p.match_head(b"parent", [2, 2]) is None and p.match_head(b"parent", []) is None
    assert p.match_head(b"nobody", [1, 2]) is None  # only blocks under the same parent chain
    held = [blocks[0], blocks[1], one[0]]
    assert [p.refs[b] for b in blocks] == [1 + held.count(b) for b in blocks]  # a reference, like match's
    p.release(held)
    p.release(blocks)  # all cached now, least recently released first: blocks[0]
    assert p.match_head(b"parent", [9, 9, 1]) == (blocks[3], 2)  # a cached block nobody holds: taken off the LRU
    got, recycled = p.take(2)  # the free block, then the least recently released: evicted and forgotten
    assert recycled == [blocks[0]] and p.match_head(b"parent", [1, 2, 3, 4]) == (blocks[1], 2)
    p.release([blocks[3], blocks[1]])
    off = BlockPool(2, caching=False)
    b, _ = off.take(1)
    assert not off.publish(b[0], b"x", b"parent", (1, 2)) and off.match_head(b"parent", [1, 2]) is None


def test_chain_hashes_name_every_token_before_and_the_weights():
    toks = list(range(50))
    root = chain_root("base", "ad-1", "tenant-a")
    h = chain_hashes(toks, 16, root)
    assert len(h) == 3  # full blocks only
    assert chain_hashes(toks[:40], 16, root) == h[:2]
    changed = chain_hashes([99] + toks[1:], 16, root)
    assert all(x != y for x, y in zip(changed, h))  # the first token changes every later block's name
    others = [chain_root("base", "ad-2", "tenant-a"), chain_root("base", "ad-1", "tenant-b"),
              chain_root("base", None, "tenant-a"), chain_root("base2", "ad-1", "tenant-a"),
              chain_root("base", "ad-1", None)]
    names = {tuple(chain_hashes(toks, 16, r)) for r in others} | {tuple(h)}
    assert len(names) == 6


# ------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def shared_prompts(dev_model):
    """Six prompts of ~170-200 tokens sharing a ~160-token system prompt, as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dev_model))
    system = " ".join(random_prompts(seed=5, count=12))
    return [tok(system + " " + p)["input_ids"] for p in random_prompts(seed=9, count=6)]


def build(dev_model, few_canaries, prefix_cache, **kw):
    canaries, index = few_canaries
    kw.setdefault("kv_cache_bytes", 16 << 20)
    e = Engine(dev_model, device="cpu", max_batch=16, rank_pools={32: 10}, prefix_cache=prefix_cache, **kw)
    for name, info in sorted(index.items()):
        e.mount_adapter(name, canaries / info["path"], rank=info["rank"], alpha=info["alpha"],
                        target_modules=info["target_modules"])
    return e


def check_references(e: Engine) -> None:
    """Every block of a live request is referenced, never cached-and-evictable nor free, and the
    references add up to the block tables exactly."""
    pool = e.kv.pool
    live = [r for r in e._requests.values() if r.blocks is not None]  # noqa: SLF001 - the accounting under test
    held: dict[int, int] = {}
    for r in live:
        for b in r.blocks:
            held[b] = held.get(b, 0) + 1
    free = set(pool._free)  # noqa: SLF001
    for b, n in held.items():
        assert pool.refs[b] == n, (b, pool.refs[b], n)
        assert b not in pool._lru and b not in free  # noqa: SLF001
    assert sum(pool.refs) == sum(held.values())


def run(e: Engine, jobs, params=GREEDY, together=False, salt=None, check=False) -> Collector:
    col = Collector()
    for rid, ids, ad in jobs:
        e.add_request(rid, ids, params, ad, col, cache_salt=salt)
        if not together:
            while e.step():
                if check:
                    check_references(e)
    while e.step():
        if check:
            check_references(e)
    return col


JOBS_ADAPTERS = [None, "c0000", "c0004"]


def jobs_of(prompts):
    return [(f"{i}-{ad}", p, ad) for i, p in enumerate(prompts) for ad in JOBS_ADAPTERS]


def test_a_burst_on_one_system_prompt_computes_it_once(dev_model, few_canaries, shared_prompts):
    """Requests that arrive together on a cold cache: the first computes the shared blocks, the ones
    behind it wait for their publication (a step) and take them, instead of each computing them in
    the same step; their continuations are then attended in bucketed calls. Same tokens as no cache."""
    jobs = [(f"{i}", p, None) for i, p in enumerate(shared_prompts)]
    ref = run(build(dev_model, few_canaries, False), jobs, together=True)
    e = build(dev_model, few_canaries, True)
    got = run(e, jobs, together=True, check=True)
    for rid, _, _ in jobs:
        assert got.tokens(rid) == ref.tokens(rid), rid
        lp = [ev.logprobs[0] for ev in got.events[rid] if ev.logprobs]
        lp_ref = [ev.logprobs[0] for ev in ref.events[rid] if ev.logprobs]
        assert torch.allclose(torch.tensor(lp), torch.tensor(lp_ref), atol=1e-4)
    assert got.final("0").cached_tokens == 0
    assert min(got.final(rid).cached_tokens for rid, _, _ in jobs[1:]) >= 128  # the system prompt's blocks
    st = e.stats()
    assert st.prefix_cache_deferred >= 1
    assert st.prefix_cache_hits == sum(got.final(rid).cached_tokens for rid, _, _ in jobs)


def test_continuations_of_unequal_length_share_one_attention_call():
    """Prefill chunks after cached prefixes, of different lengths, form one padded "cache" group
    (each chunk's tokens once, its last repeated to the longest); a lone one keeps its range."""
    from handler.model.runner import build_step_batch

    seqs = [([1, 2, 3], 16, [0, 1]), ([4, 5, 6, 7, 8], 16, [0, 2]), ([9], 33, [0, 3, 4]), ([10], 5, [6])]
    b = build_step_batch(seqs, 16, torch.device("cpu"), {None}, decode_from=3)
    cont = [g for g in b.groups if g.kind == "cache" and g.max_q > 1]
    assert len(cont) == 1
    g = cont[0]
    assert (g.num_seqs, g.max_q) == (3, 5)
    assert g.index.tolist() == [0, 1, 2, 2, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 8]
    mask = g.masks[None]
    assert mask.shape == (3, 1, 5, 48)
    assert mask[0, 0, 0].nonzero().flatten().tolist() == list(range(17))  # position 16 sees 0..16
    assert torch.equal(mask[0, 0, 4], mask[0, 0, 2])  # the padding repeats the last query's row
    assert g.block_tables.tolist() == [[0, 1, 0], [0, 2, 0], [0, 3, 4]]
    alone = build_step_batch(seqs[:1] + seqs[3:], 16, torch.device("cpu"), {None}, decode_from=1)
    assert [(g.kind, g.start, g.end, g.index) for g in alone.groups][0] == ("cache", 0, 3, None)
    # a 1-token chunk is not padded to a 100-token one at a similar context (over 2x + 1 block): two calls
    mixed = build_step_batch([([1], 120, list(range(8))), (list(range(100)), 16, list(range(8, 16)))], 16,
                             torch.device("cpu"), {None}, decode_from=2)
    assert sorted((g.num_seqs, g.max_q) for g in mixed.groups) == [(1, 1), (1, 100)]


@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_cache_hits_give_the_tokens_and_logprobs_of_no_cache(dev_model, few_canaries, shared_prompts, attention,
                                                             request):
    if attention == "paged":
        request.getfixturevalue("paged_kernel")
    jobs = jobs_of(shared_prompts)
    ref = run(build(dev_model, few_canaries, False, attention=attention), jobs)
    e = build(dev_model, few_canaries, True, attention=attention)
    one_by_one = run(e, jobs, check=True)
    batched = run(e, [(f"again-{rid}", ids, ad) for rid, ids, ad in jobs], together=True, check=True)
    for rid, _, ad in jobs:
        for got in (one_by_one, batched):
            key = rid if got is one_by_one else f"again-{rid}"
            assert got.tokens(key) == ref.tokens(rid), (key, ad)
            lp = [ev.logprobs[0] for ev in got.events[key] if ev.logprobs]
            lp_ref = [ev.logprobs[0] for ev in ref.events[rid] if ev.logprobs]
            assert torch.allclose(torch.tensor(lp), torch.tensor(lp_ref), atol=1e-4)
    first = {ad: one_by_one.final(f"0-{ad}").cached_tokens for ad in JOBS_ADAPTERS}
    assert first == {ad: 0 for ad in JOBS_ADAPTERS}  # nothing cached yet for any adapter
    later = [one_by_one.final(f"{i}-{ad}").cached_tokens for i in range(1, 6) for ad in JOBS_ADAPTERS]
    assert min(later) >= 128  # the shared system prompt: at least its 8 full blocks
    again = [batched.final(f"again-{rid}").cached_tokens for rid, ids, _ in jobs]
    assert all(c >= (len(ids) - 1) // 16 * 16 for c, (_, ids, _) in zip(again, jobs))  # whole prompts but the tail
    st = e.stats()
    assert st.prefix_cache_hits > 0 and st.prefix_cache_queries == 2 * sum(len(ids) for _, ids, _ in jobs)
    assert st.kv_cache_usage == 0.0 and sum(e.kv.pool.refs) == 0


def test_a_prompt_sharing_part_of_a_block_copies_those_tokens(dev_model, few_canaries):
    """A prompt that shares 37 tokens with a cached one (2 full blocks and 5 tokens of the third, as a
    chat template's system prompt ends mid-block) takes the blocks and copies the 5 tokens' K and V
    from the cached block into its own, which stays unwritten by it; a prompt equal to the first 40
    tokens prefills only its last. Tokens and logprobs equal the no-cache run's; another adapter or
    tenant shares nothing."""
    g = torch.Generator().manual_seed(3)
    first = torch.randint(5, 400, (50,), generator=g).tolist()
    second = first[:37] + torch.randint(5, 400, (8,), generator=g).tolist()
    second[37] = 5 + (first[37] - 4) % 395  # differs from the 38th token on
    short = first[:40]
    jobs = [("first", first, "c0000"), ("second", second, "c0000"), ("short", short, "c0000"),
            ("other-adapter", second, "c0004"), ("no-adapter", second, None)]
    ref = run(build(dev_model, few_canaries, False), jobs)
    e = build(dev_model, few_canaries, True)
    got = run(e, jobs[:1], check=True)
    src = e.kv.pool._block_of[chain_hashes(first, 16, chain_root(e.cache_key, "c0000", None))[2]]  # noqa: SLF001
    src_k = e.kv.k[:, src].clone()
    col = Collector()
    e.add_request("second", second, GREEDY, "c0000", col)
    e.step()
    blocks = e._requests["second"].blocks  # noqa: SLF001
    assert src not in blocks and torch.equal(e.kv.k[:, blocks[2], :5], src_k[:, :5])
    while e.step():
        check_references(e)
    assert torch.equal(e.kv.k[:, src], src_k)  # the cached block was copied from, never written
    got.events.update(col.events)
    got.events.update(run(e, jobs[2:3], check=True).events)
    got.events.update(run(e, jobs[3:4], check=True).events)
    got.events.update(run(e, jobs[4:], salt="tenant-b", check=True).events)
    cached = {rid: got.final(rid).cached_tokens for rid, _, _ in jobs}
    assert cached == {"first": 0, "second": 37, "short": 39, "other-adapter": 0, "no-adapter": 0}
    for rid, _, _ in jobs:
        assert got.tokens(rid) == ref.tokens(rid), rid
        lp = [ev.logprobs[0] for ev in got.events[rid] if ev.logprobs]
        lp_ref = [ev.logprobs[0] for ev in ref.events[rid] if ev.logprobs]
        assert torch.allclose(torch.tensor(lp), torch.tensor(lp_ref), atol=1e-4), rid
    assert e.stats().prefix_cache_hits == 37 + 39 and sum(e.kv.pool.refs) == 0


def test_batch_invariant_mode_hits_are_bitwise_equal(dev_model, few_canaries, shared_prompts):
    """In batch-invariant mode a hit covers whole prefill chunks only, so the rest of the prompt is cut
    as without the cache and every logprob is bit-identical."""
    jobs = jobs_of(shared_prompts)
    kw = dict(batch_invariant=True, max_prefill_tokens=64)
    ref = run(build(dev_model, few_canaries, False, **kw), jobs)
    e = build(dev_model, few_canaries, True, **kw)
    got = run(e, jobs, check=True)
    for rid, _, _ in jobs:
        assert [ev.logprobs for ev in got.events[rid]] == [ev.logprobs for ev in ref.events[rid]], rid
        assert got.final(rid).cached_tokens % 64 == 0
    assert e.stats().prefix_cache_hits > 0


def test_never_shared_across_adapters_versions_or_tenants(dev_model, few_canaries, shared_prompts):
    """The same prompt under two adapters, two versions of one adapter (another id, even with the
    same weights), two tenants, and the base: no block in common, nothing reported cached, and each
    answer equal to its own adapter's answer without a cache. The same key again: a hit on the very
    blocks it wrote."""
    canaries, index = few_canaries
    e = build(dev_model, few_canaries, True)
    info = index["c0000"]
    e.mount_adapter("c0000-v2", canaries / info["path"], rank=info["rank"], alpha=info["alpha"],
                    target_modules=info["target_modules"])
    ref = run(build(dev_model, few_canaries, False), [(ad or "base", shared_prompts[0], ad)
                                                      for ad in ("c0000", "c0004", None)])
    ref.events["c0000-v2"] = ref.events["c0000"]
    prompt = shared_prompts[0]
    full = (len(prompt) - 1) // 16
    keys = [("c0000", "t1"), ("c0004", "t1"), ("c0000-v2", "t1"), ("c0000", "t2"), (None, "t1"), (None, "t2"),
            (None, None)]
    seen: dict[tuple, list[int]] = {}
    for ad, salt in keys:
        rid = f"{ad}-{salt}"
        col = Collector()
        e.add_request(rid, prompt, GREEDY, ad, col, cache_salt=salt)
        e.step()  # admitted and prefilled: its block table is set
        seen[(ad, salt)] = list(e._requests[rid].blocks[:full])  # noqa: SLF001 - the block ids under test
        while e.step():
            pass
        assert col.final(rid).cached_tokens == 0, rid
        assert col.tokens(rid) == ref.tokens(ad or "base"), rid
    all_blocks = [b for blocks in seen.values() for b in blocks]
    assert len(all_blocks) == len(set(all_blocks)) == full * len(keys)  # pairwise disjoint
    for ad, salt in keys:  # each key again: it finds its own blocks
        col = Collector()
        e.add_request("again", prompt, GREEDY, ad, col, cache_salt=salt)
        e.step()
        assert e._requests["again"].blocks[:full] == seen[(ad, salt)]  # noqa: SLF001
        while e.step():
            pass
        assert col.final("again").cached_tokens == full * 16
        assert col.tokens("again") == ref.tokens(ad or "base")


def test_eviction_under_pressure_never_frees_a_referenced_block(dev_model, few_canaries, shared_prompts):
    """A cache of 40 blocks: long requests hold shared prefix blocks while others with distinct prompts
    keep evicting cached blocks and preempting. After every step each held block is referenced as
    often as block tables name it (never free, never evictable), the shared blocks' keys never
    change while held, and every answer equals the no-cache answer."""
    distinct = [list(p) for p in shared_prompts]
    for i, p in enumerate(distinct):  # distinct prefixes: a different first token each
        p[0] = 30 + i
    long_params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    jobs = [(f"L{i}", shared_prompts[i], "c0000") for i in range(2)] + \
           [(f"d{i}", distinct[i], ("c0004", None)[i % 2]) for i in range(6)]
    ref = run(build(dev_model, few_canaries, False), jobs, params=long_params)
    e = build(dev_model, few_canaries, True, kv_cache_bytes=40 * 16 * PER_TOKEN)
    col = Collector()
    e.add_request("L0", shared_prompts[0], long_params, "c0000", col)
    while not e._requests["L0"].out:  # noqa: SLF001
        e.step()
    e.add_request("L1", shared_prompts[1], long_params, "c0000", col)
    e.step()
    shared = e._requests["L1"].blocks[: e._requests["L1"].cached // 16]  # noqa: SLF001
    assert len(shared) >= 8 and all(e.kv.pool.refs[b] == 2 for b in shared)
    keys_before = e.kv.k[:, shared].clone()
    for rid, ids, ad in jobs[2:]:
        e.add_request(rid, ids, long_params, ad, col)
    steps = 0
    while e.step():
        steps += 1
        check_references(e)
        if any(r in e._requests for r in ("L0", "L1")):  # noqa: SLF001
            held = [b for b in shared if e.kv.pool.refs[b] > 0]
            assert torch.equal(e.kv.k[:, held], keys_before[:, [shared.index(b) for b in held]])
    st = e.stats()
    assert st.prefix_cache_evictions > 0 and st.preemptions > 0, st
    for rid, _, _ in jobs:
        assert col.tokens(rid) == ref.tokens(rid), rid
    assert st.kv_cache_usage == 0.0 and sum(e.kv.pool.refs) == 0


def test_preemption_with_shared_blocks(dev_model, few_canaries, shared_prompts):
    """Eight requests on one adapter share the system prompt's blocks in a cache too small for all
    of them: some are preempted (their shared blocks stay with the others) and recomputed, and
    every answer equals the unpreempted, uncached one."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    jobs = [(f"p{i}", shared_prompts[i % 6], "c0004") for i in range(8)]
    ref = run(build(dev_model, few_canaries, False), jobs, params=params)
    e = build(dev_model, few_canaries, True, kv_cache_bytes=32 * 16 * PER_TOKEN)
    run(e, jobs[:1], params=params)  # the system prompt is cached
    col = run(e, jobs, params=params, together=True, check=True)
    st = e.stats()
    assert st.preemptions > 0, st
    assert all(col.final(rid).cached_tokens >= 128 for rid, _, _ in jobs)
    for rid, _, _ in jobs:
        assert col.final(rid).finish_reason == "length" and col.tokens(rid) == ref.tokens(rid), rid
    assert st.kv_cache_usage == 0.0 and sum(e.kv.pool.refs) == 0
