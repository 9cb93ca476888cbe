"""Decode attention that reads the paged KV cache where it lies (no per-step gather, no padding).

For decode row b with context length c_b, block table t_b (blocks in logical order) and query q_b:

    out[b] = softmax(q_b . K[t_b][:c_b]^T / sqrt(D)) . V[t_b][:c_b]

`torch.nn.attention.flex_attention` computes it over the whole pool of one layer viewed as a single
sequence, k/v [1, kv_heads, pool blocks * block_size, D] (a view: nothing is copied). Its block
mask lists, per row, the row's blocks (`kv_num[b]` of them, ids in `kv_idx[b]`), so the kernel
visits only those and reads them in place; `mask_mod` hides, inside them, the unwritten tail of the
row's last block and, on a sliding-window layer, the part of its first visible block older than
the window. Every row reads its own blocks only: one long row costs its own blocks, not padding
on every other row (the gathered layout pads each bucket to its longest row).

The kernel is compiled (`torch.compile`, dynamic shapes: one compile serves every batch size and
block-table width): Triton on CUDA, inductor's C++ template on CPU. `probe()` compiles it once per
shape family and checks it against the gathered path on scattered blocks and mixed lengths; it
times nothing. Which path "auto" takes is a fixed rule of device and shapes (`prefers_paged`): a
timing taken while a replica starts on a busy machine could pick another path on another replica or
after a restart, and the paths differ in reduction order. `measure()` times both paths, for
benchmarks (and for revisiting the rule), never at start-up.

The block-table buffer `kv_idx` is persistent (`DecodeTables`): the kernel needs it as wide as the
pool, so it is allocated once per cache and only the first `nb` columns of the step's rows are
written each step, from pinned host memory with a non-blocking copy.

Imports go one way: this module imports the runner and the KV cache (the probe runs the runner's
gathered path on a real cache); the runner never imports this module, it calls the kernel through
the `PagedDecode` that the `DecodeTables` handed to `build_step_batch` built (`PagedDecode.attend`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

from handler.model.kvcache import KVCache
from handler.model.runner import attend_group, build_step_batch
from handler.model.tensors import to_device

log = logging.getLogger(__name__)

_compiled = None
_compile_lock = threading.RLock()
_probes: dict[tuple, "Probe"] = {}
compile_seconds = 0.0  # spent in probes (compiling the kernel, or loading it from inductor's cache): a start phase


def _flex_decode(q, k, v, kv_num, kv_idx, last_blk, tail, first_blk, head_skip, block_size: int):
    """q [B, H, 1, D]; k, v [1, KVH, S, D] (the whole pool); the rest [B] (kv_num [B, 1, 1], kv_idx
    [B, 1, 1, S / block_size]). Returns [B, H, 1, D]."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def mask_mod(b, h, q_idx, kv):
        blk = kv // block_size
        off = kv % block_size
        written = (blk != last_blk[b]) | (off < tail[b])
        in_window = (blk != first_blk[b]) | (off >= head_skip[b])
        return written & in_window

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(128, block_size), mask_mod=mask_mod,
                                    compute_q_blocks=False, seq_lengths=(q.shape[2], k.shape[2]))
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# inductor's CPU flex template sizes its per-thread scratch by the thread count at compile time and
# indexes it by the thread running it: compiled with fewer threads than it later runs with, it writes
# past its buffers (seen: heap corruption after a kernel compiled under torch.set_num_threads(1) ran
# with 2). So it is compiled for every core, and refuses to run with more threads than that.
_CPU_THREADS = max(os.cpu_count() or 1, torch.get_num_threads())


class PagedKernelError(RuntimeError):
    """The paged kernel cannot run here (the engine falls back to the gathered path)."""


def _kernel():
    global _compiled
    with _compile_lock:
        if _compiled is None:
            import torch._dynamo.config

            # one compile per dtype, head layout, block size and window set (and for one row): a
            # process with several engines or models may need more than dynamo's default of 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            _compiled = torch.compile(_flex_decode, fullgraph=True, options={"cpp.threads": _CPU_THREADS})
        return _compiled


def is_compile_error(e: BaseException) -> bool:
    """Whether `e` is the paged kernel's: torch.compile's (a recompile for a new shape can fail
    where the probe's passed) or `PagedKernelError`."""
    exc = sys.modules.get("torch._dynamo.exc")  # imported only once something was compiled
    return isinstance(e, PagedKernelError) or (exc is not None and isinstance(e, exc.TorchDynamoException))


@dataclass
class WindowTables:
    """One window's view of the step's decode rows (None: full attention)."""

    kv_num: torch.Tensor  # [B, 1, 1] int32: visible blocks per row
    kv_idx: torch.Tensor  # [B, 1, 1, pool blocks] int32 (first kv_num[b] columns valid)
    first_blk: torch.Tensor  # [B] int64: the first visible block's id
    head_skip: torch.Tensor  # [B] int64: offsets in it older than the window (0: none)


@dataclass
class PagedDecode:
    """Metadata of the step's decode rows for `attend`, built once per step and shared by layers."""

    last_blk: torch.Tensor  # [B] int64: the last block's id
    tail: torch.Tensor  # [B] int64: tokens written in the last block (1..block_size)
    windows: dict  # window (None or int) -> WindowTables
    block_size: int

    def attend(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, window) -> torch.Tensor:
        """`attend` with this metadata: how the runner (which does not import this module) calls the
        kernel for a "paged" group."""
        return attend(q, k_layer, v_layer, self, window)


class DecodeTables:
    """Persistent block-table buffers of one KV cache (one per window of the model), written once
    per step through pinned host memory with non-blocking copies."""

    def __init__(self, kv, max_rows: int):
        """For the cache `kv` (a `handler.model.kvcache.KVCache`): as wide as its whole pool of blocks."""
        self.width, self.block_size, self.device = kv.k.shape[1], kv.block_size, kv.device
        self.max_rows = max_rows
        self._dev: dict = {}

    def _buffer(self, window, rows: int) -> torch.Tensor:
        buf = self._dev.get(window)
        if buf is None or buf.shape[0] < rows:
            with torch.inference_mode(False):  # a normal tensor, written to in and out of inference mode
                buf = torch.zeros((max(rows, self.max_rows), 1, 1, self.width), dtype=torch.int32, device=self.device)
            self._dev[window] = buf
        return buf

    def build(self, ctx: list[int], tables: list[list[int]], windows) -> PagedDecode:
        """Decode rows with context lengths `ctx` (the new token included) and block tables `tables`."""
        bs = self.block_size
        B = len(ctx)
        nb = [-(-c // bs) for c in ctx]
        out = {}
        for w in windows:
            # visible keys j: q - j < w with q = c - 1, so the first visible position is c - w
            start = [0 if w is None else max(0, c - w) for c in ctx]
            sb = [s // bs for s in start]
            width = max(n - s for n, s in zip(nb, sb))
            host = torch.zeros((B, width), dtype=torch.int32)
            for b in range(B):
                row = tables[b][sb[b] : nb[b]]
                host[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
            if self.device.type == "cuda":
                host = host.pin_memory()
            buf = self._buffer(w, B)[:B]
            buf[:, 0, 0, :width].copy_(host, non_blocking=True)
            _mark_rows(buf)
            torch._dynamo.maybe_mark_dynamic(buf, 3)  # the pool's width in blocks: any cache size
            out[w] = WindowTables(_mark_rows(_rows([n - s for n, s in zip(nb, sb)], self.device,
                                                   torch.int32).view(B, 1, 1)), buf,
                                  _rows([t[s] for t, s in zip(tables, sb)], self.device),
                                  _rows([s - s0 * bs for s, s0 in zip(start, sb)], self.device))
        return PagedDecode(_rows([t[n - 1] for t, n in zip(tables, nb)], self.device),
                           _rows([c - (n - 1) * bs for c, n in zip(ctx, nb)], self.device), out, bs)


def _rows(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """One tensor of its own per operand (views into a shared one would add storage-offset guards
    to the compiled kernel). The mask's operands are int64 like the kernel's kv index (an int32
    operand makes inductor's CPU template emit a vector cast that does not compile for some shapes)."""
    return _mark_rows(to_device(torch.tensor(values, dtype=dtype), device))


def _mark_rows(t: torch.Tensor) -> torch.Tensor:
    """Dim 0 (the rows) dynamic: one compile serves every batch size, not one per size. Done once
    per step for the step's metadata, shared by every layer's call."""
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return t


def attend(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, meta: PagedDecode, window) -> torch.Tensor:
    """q [B, H, D] of the decode rows; k_layer, v_layer [pool blocks, block_size, KVH, D] (one
    layer of the cache). Returns [B, H, D]."""
    if k_layer.device.type == "cpu" and torch.get_num_threads() > _CPU_THREADS:
        raise PagedKernelError(f"{torch.get_num_threads()} torch threads, the kernel is built for {_CPU_THREADS}")
    n, bs, kvh, d = k_layer.shape
    k = k_layer.view(n * bs, kvh, d).permute(1, 0, 2).unsqueeze(0)
    v = v_layer.view(n * bs, kvh, d).permute(1, 0, 2).unsqueeze(0)
    w = meta.windows[window]
    # q copied: a slice of the step's queries has a storage offset, which the compiled kernel would
    # specialize on (a recompile per offset seen)
    q4 = _mark_rows(q.clone().unsqueeze(2))
    # a symbolic pool length: with every size static (as at one row, which is always specialized),
    # inductor's CPU backend picks its flash-decoding template, whose C++ for a mask_mod does not
    # compile in torch 2.13 ("cur_kvSplitSize8 was not declared")
    torch._dynamo.maybe_mark_dynamic(k, 2)
    torch._dynamo.maybe_mark_dynamic(v, 2)
    out = _kernel()(q4, k, v, w.kv_num, w.kv_idx, meta.last_blk, meta.tail, w.first_blk, w.head_skip, bs)
    return out.squeeze(2)


# On the CPU the paged kernel beat the gathered copy at Llama-2-7B dims (32 kv heads x 128) and lost
# at the dev models' (2 x 32, 2 x 64): `make bench`, docs/benchmarks.md. Below this many K values
# per token and layer the CPU keeps the gathered path; CUDA always takes the paged kernel.
CPU_PAGED_MIN_KV_WIDTH = 1024


def prefers_paged(device: torch.device | str, kv_heads: int, head_dim: int) -> bool:
    """The "auto" rule: the paged kernel (where `probe` finds it compiles and is correct) on CUDA,
    and on the CPU for models of at least CPU_PAGED_MIN_KV_WIDTH K values per token and layer.
    A function of the device type and shapes only: every replica of a model picks the same path."""
    return torch.device(device).type == "cuda" or kv_heads * head_dim >= CPU_PAGED_MIN_KV_WIDTH


@dataclass
class Probe:
    """The paged kernel's check against the gathered path. Times only from `measure` (benchmarks):
    "mixed" (context lengths up to 20 blocks, one row at 20) and "short" (1 to 6 blocks)."""

    ok: bool
    reason: str
    paged_ms: float = float("nan")  # mixed
    gathered_ms: float = float("nan")
    short_paged_ms: float = float("nan")
    short_gathered_ms: float = float("nan")

    @property
    def faster(self) -> bool:
        """Measured no slower on either workload (only meaningful after `measure`)."""
        return self.ok and self.paged_ms <= self.gathered_ms and self.short_paged_ms <= self.short_gathered_ms


def probe(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
          windows=(None,), rows: int = 32) -> Probe:
    """Compile the kernel and check it against the gathered path (bucketed, as `build_step_batch`
    builds it) on scattered blocks and mixed lengths for each window and at several batch sizes.
    No timing. Cached per shape family.

    `attend` compiles for dynamic batch sizes (one compile for 2 rows and more; one more for a
    single row, which torch always specializes), so the check covers 32, 3 and 1 rows. The probe
    runs as `Runner.forward` does (inference mode, a cache made outside it), since grad mode and
    the tensors' dispatch keys are part of the compiled kernel's guards: a mismatch would mean a
    recompile in the middle of serving."""
    return _cached(device, dtype, heads, kv_heads, head_dim, block_size, windows, rows, timed=False)


def measure(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
            windows=(None,), rows: int = 32) -> Probe:
    """`probe` plus the times of both paths at `rows` decode rows on both workloads (benchmarks)."""
    return _cached(device, dtype, heads, kv_heads, head_dim, block_size, windows, rows, timed=True)


def _cached(device, dtype, heads, kv_heads, head_dim, block_size, windows, rows, timed: bool) -> Probe:
    device = torch.device(device)
    windows = tuple(sorted(set(windows), key=lambda w: -1 if w is None else w))
    key = (str(device), dtype, heads, kv_heads, head_dim, block_size, windows, rows, timed)
    global compile_seconds
    with _compile_lock:  # one probe at a time: concurrent ones would compile twice (and skew times)
        if key not in _probes:
            t0 = time.monotonic()
            _probes[key] = _probe(device, dtype, heads, kv_heads, head_dim, block_size, windows, rows, timed)
            compile_seconds += time.monotonic() - t0
        return _probes[key]


def _probe(device, dtype, heads, kv_heads, head_dim, block_size, windows, rows, timed: bool) -> Probe:
    g = torch.Generator().manual_seed(0)
    n_rows = max(rows, 32)
    kv = KVCache(1, kv_heads, head_dim, n_rows * 28, block_size, dtype, device)
    kv.k[0, :-2].copy_(torch.randn(kv.k[0, :-2].shape, generator=g))
    kv.v[0, :-2].copy_(torch.randn(kv.v[0, :-2].shape, generator=g))
    perm = torch.randperm(kv.num_blocks, generator=g).tolist()

    def rows_of(ctx: list[int]):
        out = []
        for c in ctx:
            n = -(-c // block_size)
            out.append(([0], c - 1, [perm.pop() for _ in range(n)]))
        return out

    mixed_ctx = [int(x) for x in torch.randint(1, block_size * 20, (n_rows,), generator=g)]
    mixed_ctx[1] = block_size * 20  # one long row among short ones
    mixed = rows_of(mixed_ctx)
    short = rows_of([int(x) for x in torch.randint(1, block_size * 6, (n_rows,), generator=g)])
    q = torch.randn((n_rows, heads, head_dim), generator=g).to(device, dtype)
    tables = DecodeTables(kv, n_rows)
    wset = set(windows)

    def batches(seqs):
        ref = build_step_batch(seqs, block_size, device, wset, decode_from=0, pad_block=kv.null_block)
        paged = build_step_batch(seqs, block_size, device, wset, decode_from=0, pad_block=kv.null_block,
                                 decode_tables=tables)
        return paged, ref

    def run(batch, window) -> torch.Tensor:
        b = len(batch.token_ids)
        out = torch.empty_like(q[:b])
        for grp in batch.groups:
            if grp.index is None:
                out[grp.start : grp.end] = attend_group(q[grp.start : grp.end], None, None, grp, kv, 0, window)
            else:
                out.index_copy_(0, grp.index, attend_group(q[grp.index], None, None, grp, kv, 0, window))
        return out

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        t0 = time.perf_counter()
        for seqs in (mixed, mixed[:3], mixed[:1], short):
            paged, ref = batches(seqs)  # built outside inference mode, as the engine builds them
            with torch.inference_mode():
                for w in windows:
                    err = (run(paged, w).float() - run(ref, w).float()).abs().max().item()
                    if not err <= tol:
                        return Probe(False, f"differs from the gathered path by {err:.3g} (window {w}, "
                                            f"{len(seqs)} rows)")
        compile_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - no compiler, no Triton, an unsupported shape: the gathered path
        return Probe(False, f"unavailable: {type(e).__name__}: {e}"[:300])

    if not timed:
        p = Probe(True, f"compiled and checked in {compile_s:.1f} s")
        log.info("paged decode attention (%s, %s, %d/%d heads, D %d, block %d): %s", device, dtype, heads,
                 kv_heads, head_dim, block_size, p.reason)
        return p

    @torch.inference_mode()
    def once(batch) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        run(batch, windows[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t) * 1e3

    times = {}
    for name, seqs in (("mixed", mixed[:rows]), ("short", short[:rows])):
        paged, ref = batches(seqs)
        once(paged), once(ref)
        t = [(once(paged), once(ref)) for _ in range(7)]  # interleaved: both see the same noise
        times[name] = (min(x[0] for x in t), min(x[1] for x in t))
    p = Probe(True, f"compiled and checked in {compile_s:.1f} s", *times["mixed"], *times["short"])
    log.info("paged decode attention (%s, %s, %d/%d heads, D %d, block %d, %d rows): mixed lengths %.3f ms vs "
             "gathered %.3f ms, short %.3f vs %.3f ms (%s)", device, dtype, heads, kv_heads, head_dim, block_size,
             rows, p.paged_ms, p.gathered_ms, p.short_paged_ms, p.short_gathered_ms, p.reason)
    return p
