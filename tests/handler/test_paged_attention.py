"""The paged decode kernel (handler.model.paged_attention): in place on scattered blocks, equal to
attention over each row's own keys, for every batch size, window, dtype and block size."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from handler.model import paged_attention
from handler.model.kvcache import KVCache
from handler.model.runner import attend_group, build_step_batch
from handler.model.paged_attention import DecodeTables


def reference(q, kv: KVCache, seqs, window):
    """Row by row: the row's keys copied out in logical order, cut to its length (and window)."""
    bs = kv.block_size
    out = []
    for b, (_, pos, table) in enumerate(seqs):
        c = pos + 1
        k = kv.k[0][table].flatten(0, 1)[:c]
        v = kv.v[0][table].flatten(0, 1)[:c]
        if window is not None:
            k, v = k[max(0, c - window) :], v[max(0, c - window) :]
        out.append(F.scaled_dot_product_attention(q[b : b + 1, :, None].float(), k.transpose(0, 1)[None].float(),
                                                  v.transpose(0, 1)[None].float(), enable_gqa=True)[:, :, 0])
        assert len(table) == -(-c // bs)
    return torch.cat(out)


def scattered_rows(kv: KVCache, lengths: list[int], seed: int):
    """Decode rows of these context lengths on blocks drawn at random from the whole pool."""
    rng = random.Random(seed)
    free = list(range(kv.num_blocks))
    rng.shuffle(free)
    seqs = []
    for c in lengths:
        n = -(-c // kv.block_size)
        seqs.append(([0], c - 1, [free.pop() for _ in range(n)]))
    return seqs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 4])
def test_paged_decode_equals_attention_over_each_rows_own_keys(dtype, tol, block_size, paged_kernel):
    g = torch.Generator().manual_seed(0)
    kv = KVCache(1, 2, 32, 800 if block_size == 16 else 3000, block_size, dtype)
    kv.k[0, :-1].copy_(torch.randn(kv.k[0, :-1].shape, generator=g))
    kv.v[0, :-1].copy_(torch.randn(kv.v[0, :-1].shape, generator=g))
    tables = DecodeTables(kv, 32)
    for rows, seed in [(32, 1), (3, 2), (1, 3), (17, 4)]:
        lengths = [random.Random(seed + i).choice([1, 2, 15, 16, 17, 40, 100]) for i in range(rows)]
        lengths[0] = 1000 if rows > 1 else lengths[0]  # one long row among short ones
        seqs = scattered_rows(kv, lengths, seed)
        q = torch.randn((rows, 4, 32), generator=g).to(dtype)
        for window in (None, 24, 5):
            batch = build_step_batch(seqs, block_size, torch.device("cpu"), {window}, decode_from=0,
                                     pad_block=kv.null_block, decode_tables=tables)
            (grp,) = batch.groups
            assert grp.kind == "paged" and grp.block_tables is None  # no gathered copy of any block
            got = attend_group(q, None, None, grp, kv, 0, window).float()
            want = reference(q, kv, seqs, window)
            assert (got - want).abs().max().item() <= tol, (rows, window)


def test_paged_decode_reads_no_other_rows_blocks(paged_kernel):
    """Poison every block no row owns (inf and NaN) and the unwritten tails: no output changes."""
    kv = KVCache(1, 2, 32, 400, 16)
    g = torch.Generator().manual_seed(5)
    kv.k[0, :-1].copy_(torch.randn(kv.k[0, :-1].shape, generator=g))
    kv.v[0, :-1].copy_(torch.randn(kv.v[0, :-1].shape, generator=g))
    seqs = scattered_rows(kv, [5, 33, 200, 16, 17], seed=6)
    q = torch.randn((5, 4, 32), generator=g)
    tables = DecodeTables(kv, 8)
    batch = build_step_batch(seqs, 16, torch.device("cpu"), {None}, decode_from=0, pad_block=kv.null_block,
                             decode_tables=tables)
    before = attend_group(q, None, None, batch.groups[0], kv, 0, None)
    owned = {b for s in seqs for b in s[2]}
    for b in range(kv.k.shape[1]):
        if b not in owned:
            kv.k[0, b] = float("inf")
            kv.v[0, b] = float("nan")
    # and the unwritten tail of each row's last block, with large finite values (the cache keeps
    # it zero: freed blocks are zeroed, because a masked NaN would still reach the sum as 0 * NaN)
    for _, pos, table in seqs:
        off = (pos + 1) % 16
        if off:
            kv.k[0, table[-1], off:] = 1e4
            kv.v[0, table[-1], off:] = 1e4
    after = attend_group(q, None, None, batch.groups[0], kv, 0, None)
    assert torch.isfinite(after).all()
    assert torch.equal(before, after)


def test_probe_checks_without_timing_and_measure_times_both_paths(paged_kernel):
    """The start-up probe compiles and checks the kernel but times neither path (the path is chosen
    by a fixed rule, `prefers_paged`); `measure` (benchmarks) times both."""
    p = paged_attention.probe("cpu", torch.float32, 4, 2, 32, 16, windows=(None, 24), rows=8)
    assert p.ok, p.reason
    assert all(t != t for t in (p.paged_ms, p.gathered_ms, p.short_paged_ms, p.short_gathered_ms))  # NaN
    assert paged_attention.probe("cpu", torch.float32, 4, 2, 32, 16, windows=(24, None), rows=8) is p  # cached
    m = paged_attention.measure("cpu", torch.float32, 4, 2, 32, 16, windows=(None, 24), rows=8)
    assert m.ok and m.paged_ms > 0 and m.gathered_ms > 0
    assert m.faster == (m.paged_ms <= m.gathered_ms and m.short_paged_ms <= m.short_gathered_ms)


def test_kernel_compiled_under_one_thread_runs_safely_with_more(paged_kernel):
    """The CPU kernel's scratch is sized by the thread count it was compiled with: compiled under
    torch.set_num_threads(1) and run with 2 threads it once wrote past its buffers (heap corruption).
    It is now built for every core and refuses to run with more threads than that."""
    import torch._dynamo

    old = torch.get_num_threads()
    kv = KVCache(1, 2, 32, 600, 16)
    g = torch.Generator().manual_seed(7)
    kv.k[0, :-2].copy_(torch.randn(kv.k[0, :-2].shape, generator=g))
    kv.v[0, :-2].copy_(torch.randn(kv.v[0, :-2].shape, generator=g))
    seqs = scattered_rows(kv, [300, 17, 5, 250] * 4, seed=8)
    q = torch.randn((16, 4, 32), generator=g)
    batch = build_step_batch(seqs, 16, torch.device("cpu"), {None}, decode_from=0, pad_block=kv.null_block,
                             decode_tables=DecodeTables(kv, 16))
    want = reference(q, kv, seqs, None)
    try:
        torch._dynamo.reset()
        paged_attention._compiled = None
        torch.set_num_threads(1)
        attend_group(q, None, None, batch.groups[0], kv, 0, None)  # compiled with one thread
        torch.set_num_threads(2)
        for _ in range(50):
            got = attend_group(q, None, None, batch.groups[0], kv, 0, None)
            assert (got - want).abs().max().item() <= 1e-5
        torch.set_num_threads(paged_attention._CPU_THREADS + 1)
        with pytest.raises(paged_attention.PagedKernelError):
            attend_group(q, None, None, batch.groups[0], kv, 0, None)
    finally:
        torch.set_num_threads(old)
