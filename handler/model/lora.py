"""Batched multi-LoRA: many adapters in one batch, one base product, no loop over requests.

Semantics (per adapted module with base weight W [d, k], for every token row i of the batch):

    y[i] = x[i] @ W.T                                              (once, for the whole batch)
    y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T,   s = slot_of_row[i]

with A[s] [r, k], B[s] [d, r] and scale[s] = alpha / r (alpha / sqrt(r) with rsLoRA). Slot 0 means
"no adapter": its stacks stay zero and rows on slot 0 are skipped entirely.

Rank pools. Slots are grouped into pools by rank class, e.g. {8: 8, 16: 8, 32: 8, 64: 4} (rank:
slot count). An adapter of rank r lives in the smallest pool with rank >= r and is zero-padded only
up to that pool's rank, so a rank-8 adapter never pays for rank-64 padding. Each pool has its own
stacks; a step computes the delta once per pool that has rows in the batch (at most a handful),
never once per request.

Kernels (pure torch, shared by every layer, metadata built once per step by `ModelLoRA.prepare`):
  * SGMV (segmented gather matrix-vector): rows are grouped by slot into segments (a prefill chunk
    is one long segment); segments are padded to a common length L.
  * BGMV (batched gather matrix-vector): the L = 1 case, one segment per row, for decode batches
    of many distinct adapters.
    Both read the stacks in place, never copying adapter weights: segments are cut into runs on
    consecutive slots (one `torch.bmm` over a `narrow` view of the stacks per run) or on one slot
    (one matmul), so LRU-scattered slots cost one small product per run, not a gathered copy. The
    copying form (`index_select` of A[seg_slots], B[seg_slots], then one bmm) stays as the
    "gather" kernel for comparison.
  * Dense: one matmul against the pool's slots lo..hi that the step uses (x @ A[lo:hi].T, a view),
    a per-token slot choice with `torch.where` (not a 0/1 product: an inf that an adapter's finite
    weights produce in its own column stays out of every other row; 0 * inf would be NaN), one
    matmul against B[lo:hi]. Fewest calls, but every token multiplies every slot of the range.
  * A single adapter over the whole batch is one segment without any gather (two thin matmuls).
The segment length minimises padded rows + weight reads; the kernel is chosen per pool and step by
`ModelLoRA.estimate`: call count x per-call cost + weight bytes / bandwidth + MACs / rate, with
fixed constants per device type and dtype (`kernel_costs`: never timed at start-up, so the choice is a
function of the step's shapes and the device only; a calibration stored on an idle machine may
replace them).
  * Invariant (`kernel = "invariant"`, the engine's batch-invariant mode): every token is its own
    [1, k] product against its slot's copied stacks (one bmm per group and module), so a row's delta
    has the same reduction order whatever the batch and the slots around it.

Adapters with NaN or infinite values are rejected at `set_adapter`, and so are adapters whose A
or scale * B do not fit the slot dtype (scaled B past 65,504 in float16): stored weights are
always finite, so only a product can overflow, and it stays in its own rows.

Layer contract (after vLLM's `lora/layers/base.py`):
  `MultiLoRALinear.create_lora_weights(pools, dtype, device)`, `.set_lora(pool, slot, a, b, scale)`,
  `.reset_lora(pool, slot)`, `.apply(x, y, batch)`.
One `MultiLoRALinear` covers the modules that share an input (q/k/v, gate/up, o, down): their A
matrices are stacked so the shrink `x @ A.T` is one product for the group; B is stored transposed
and scaled at `set_lora` time (B'.T = scale * B.T), which is the formula above with the scalar
moved into the stored weights.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch

from handler.model.runner import LORA_MODULES, ModelConfig
from handler.model.tensors import to_device, zeroed

# The groups of modules that share an input, in the order their outputs sit in the fused base output.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
GROUP_OF_MODULES = {mods: name for name, mods in GROUPS.items()}

_PEFT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(LORA_MODULES) + r")\.lora_([AB])(?:\.[^.]+)?\.weight$"
)


class InvalidAdapterWeightsError(ValueError):
    """Adapter tensors that do not match the base model or the declared rank / target modules."""


# ------------------------------------------------------------------------------------ step metadata


@dataclass
class PoolBatch:
    """The rows of one rank pool in one step and the kernel that computes them (module docstring).

    mode "whole":  one adapter (`first_slot`) covers every token of the step, in order;
    mode "rows":   BGMV, one segment per token, tokens in order;
    mode "gather": SGMV, segments of up to `seg_len` tokens of one slot, padded; `gather` [U, L]
                   holds token indices, `out_index` the token of every valid position and `valid`
                   (None without padding) those positions in the flattened [U*L];
    mode "dense":  the slots lo .. lo + width - 1 of the pool at once; `mask` [T, width] (bool)
                   picks each token's slot with `torch.where`.
    Segment modes read the stacks in place, one product per run of segments: `runs` holds
    (u0, u1, slot, step): segments u0..u1-1 sit on slots slot, slot + step, ... (step 1: one bmm
    over a view of the stack; step 0: one slot, one matmul). With `seg_slots` set (the "gather"
    kernel choice, kept for comparison) the stacks are copied with index_select instead.
    """

    pool: int
    mode: str
    first_slot: int = 0
    num_segments: int = 0
    seg_len: int = 1
    runs: tuple = ()
    seg_slots: torch.Tensor | None = None  # [U] local slots, only when the weights are copied
    gather: torch.Tensor | None = None
    out_index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    lo: int = 0
    width: int = 0

    @property
    def contiguous(self) -> bool:
        """Segments on consecutive slots: one product over a view of the stacks."""
        return self.seg_slots is None and len(self.runs) == 1 and self.runs[0][3] == 1


@dataclass
class LoRABatch:
    pools: list[PoolBatch]


def _plan_segments(counts: list[int], rank: int) -> int:
    """Segment length minimising gathered-weight traffic (rank rows per segment) + padded rows."""
    lmax = max(counts)
    candidates = {lmax}
    p = 1
    while p < lmax:
        candidates.add(p)
        p *= 2
    best, best_cost = lmax, None
    for L in sorted(candidates):
        nseg = sum(-(-c // L) for c in counts)
        cost = nseg * rank + nseg * L
        if best_cost is None or cost < best_cost or (cost == best_cost and L > best):
            best, best_cost = L, cost
    return best


def _runs(seg_slots: list[int]) -> tuple:
    """Maximal runs (u0, u1, first slot, step) of segments on consecutive (step 1) or equal (step 0) slots."""
    runs = []
    u0 = 0
    n = len(seg_slots)
    while u0 < n:
        u1 = u0 + 1
        step = 1 if u1 < n and seg_slots[u1] == seg_slots[u0] + 1 else 0
        while u1 < n and seg_slots[u1] == seg_slots[u1 - 1] + step:
            u1 += 1
        runs.append((u0, u1, seg_slots[u0], step))
        u0 = u1
    return tuple(runs)


# ------------------------------------------------------------------------------ kernel choice


@dataclass(frozen=True)
class KernelCosts:
    """Per-device constants of the kernel-choice estimate, fixed per (device type, dtype) (`FIXED_COSTS`):

        time = calls x call_s + weight bytes / read_bps + copied bytes / copy_bps + MACs / macs_per_s
    """

    call_s: float  # fixed cost of one small op (dispatch on CPU, launch on GPU)
    read_bps: float  # bytes/s a thin (decode-sized) matmul streams its weights at
    copy_bps: float  # bytes/s of an index_select copy of stack rows
    macs_per_s: float  # multiply-adds/s of a wide matmul


_COSTS: dict = {}

# Fixed constants per device type and dtype: the kernel choice is a function of the step's shapes and
# the device only, never of a timing taken at start-up (a busy machine would pick other kernels, and
# kernels differ in reduction order: the same request could decode differently on two replicas or
# after a restart). Orders of magnitude measured on an idle 2-core EPYC (torch 2.13, one thread) and
# typical of a recent datacenter GPU; only their ratios matter. A stored calibration can replace them
# (`LORAFARM_KERNEL_COSTS`, written by `python -m handler.model.lora calibrate FILE` on an idle machine).
FIXED_COSTS: dict[tuple[str, str], tuple[float, float, float, float]] = {
    ("cpu", "float32"): (2.5e-6, 4e9, 4e10, 3e10),
    ("cpu", "bfloat16"): (2.5e-6, 2e8, 4e10, 3e9),
    ("cpu", "float16"): (2.5e-6, 2e8, 4e10, 3e9),
    ("cuda", "float32"): (8e-6, 2e12, 1e12, 2e13),
    ("cuda", "bfloat16"): (8e-6, 2e12, 1e12, 2e14),
    ("cuda", "float16"): (8e-6, 2e12, 1e12, 2e14),
}
COSTS_ENV = "LORAFARM_KERNEL_COSTS"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stored_costs(device: torch.device, dtype: torch.dtype) -> KernelCosts | None:
    """The calibration stored in $LORAFARM_KERNEL_COSTS (JSON {"cpu/float32": [call_s, read_bps,
    copy_bps, macs_per_s]}) for this device, if any: read, never measured, at start-up."""
    path = os.environ.get(COSTS_ENV)
    if not path:
        return None
    import json

    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    v = table.get(f"{device.type}/{_dtype_name(dtype)}")
    return KernelCosts(*(float(x) for x in v)) if v and len(v) == 4 else None


def kernel_costs(device: torch.device, dtype: torch.dtype) -> KernelCosts:
    """The constants for this device type and dtype: a stored calibration if one is configured, else
    `FIXED_COSTS`. Never timed here: the same shapes pick the same kernel on every replica."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _COSTS:
        stored = _stored_costs(device, dtype)
        fixed = FIXED_COSTS.get((device.type, _dtype_name(dtype))) or FIXED_COSTS[(device.type if device.type in
                                                                                   ("cpu", "cuda") else "cpu", "float32")]
        _COSTS[key] = stored or KernelCosts(*fixed)
    return _COSTS[key]


def calibrate(device: torch.device, dtype: torch.dtype) -> KernelCosts:
    """Time four small ops (min of a few runs). Only for `python -m handler.model.lora calibrate`, run on an
    idle machine; its output is stored and reused, never measured while serving starts."""
    return _calibrate(torch.device(device), dtype)


def _calibrate(device: torch.device, dtype: torch.dtype) -> KernelCosts:
    """Time four small ops (min of a few runs, robust to other jobs on a shared machine)."""
    import time

    def timed(fn, n):
        fn()
        best = float("inf")
        for _ in range(n):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best

    with torch.inference_mode():
        k, d = 1024, 1024
        g = torch.Generator().manual_seed(0)
        W = torch.randn(d, k, generator=g).to(device, dtype)
        x1, xw = torch.randn(32, k, generator=g).to(device, dtype), torch.randn(256, k, generator=g).to(device, dtype)
        a, b = torch.randn(1, 1, 16).to(device, dtype), torch.randn(1, 16, 16).to(device, dtype)
        stack = torch.randn(32, 32, k, generator=g).to(device, dtype)
        idx = torch.arange(0, 32, 2, device=device)
        es = W.element_size()
        call = timed(lambda: torch.bmm(a, b), 20)
        thin = timed(lambda: x1 @ W.T, 5)
        wide = timed(lambda: xw @ W.T, 3)
        copy = timed(lambda: stack.index_select(0, idx), 5)
    return KernelCosts(
        call_s=call,
        read_bps=W.numel() * es / max(thin - call, 1e-7),
        copy_bps=2 * idx.numel() * 32 * k * es / max(copy - call, 1e-7),
        macs_per_s=max(256 * W.numel() / max(wide - call, 1e-7), 32 * W.numel() / max(thin - call, 1e-7)),
    )


# ----------------------------------------------------------------------------------------- layers


class MultiLoRALinear:
    """Per-pool LoRA stacks for one group of modules of one layer.

    Stacks per pool p with rank r_p and S_p slots (+ slot 0):
        A[p]:    [S_p + 1, n_mod * r_p, k]  (module m's A at rows m*r_p .. m*r_p + r)
        B[p][m]: [S_p + 1, r_p, d_m]        (module m's (scale * B).T, zero-padded rows past r)
    The group's output `y` has the modules' outputs side by side in the same order (the fused base
    output), so module m adds into y[:, off_m : off_m + d_m].
    """

    def __init__(self, modules: tuple[str, ...], in_features: int, out_features: list[int]):
        self.modules = modules
        self.k = in_features
        self.d = list(out_features)
        self.offsets = [sum(self.d[:m]) for m in range(len(self.d))]
        self.A: list[torch.Tensor] = []
        self.B: list[list[torch.Tensor]] = []
        self.ranks: list[int] = []

    def create_lora_weights(self, pools: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
        """Allocate zeroed stacks for pools [(rank, slots)]; slot 0 of each pool is the no-adapter slot."""
        n = len(self.modules)
        self.ranks = [r for r, _ in pools]
        # zero pages nobody wrote take no memory (handler.model.tensors.zeroed): slot 0, never read, and
        # slots no adapter has used yet
        shapes = [(s + 1, n * r, self.k) for r, s in pools] + [(s + 1, r, d) for r, s in pools for d in self.d]
        stacks = zeroed(shapes, dtype, device)
        self.A = stacks[: len(pools)]
        self.B = [stacks[len(pools) + i * n : len(pools) + (i + 1) * n] for i in range(len(pools))]

    def set_lora(
        self,
        pool: int,
        slot: int,
        a: Mapping[str, torch.Tensor],
        b: Mapping[str, torch.Tensor],
        scale: Mapping[str, float],
    ) -> None:
        """Write an adapter into (pool, slot): a[m] [r_m, k], b[m] [d_m, r_m], scale[m], per module m
        of this group present in `a` (absent modules stay zero). r_m <= pool rank; zero-padded."""
        if slot == 0:
            raise ValueError("slot 0 is the no-adapter slot")
        self.reset_lora(pool, slot)
        r_p = self.ranks[pool]
        A = self.A[pool][slot]
        for m, name in enumerate(self.modules):
            if name not in a:
                continue
            am, bm = a[name], b[name]
            r = am.shape[0]
            A[m * r_p : m * r_p + r].copy_(am)
            self.B[pool][m][slot, :r].copy_((bm.to(torch.float32) * float(scale[name])).T)

    def reset_lora(self, pool: int, slot: int) -> None:
        self.A[pool][slot].zero_()
        for B in self.B[pool]:
            B[slot].zero_()

    def write_slot(self, pool: int, slot: int, a: torch.Tensor | None, bs: list[torch.Tensor | None]) -> None:
        """Copy prepared stacks (a `SlotImage` entry) into (pool, slot): `a` [n_mod * r_p, k] and
        `bs[m]` [r_p, d_m] already padded, transposed, scaled and in the stack dtype, so each is one
        copy; None zeroes that stack (the only rows the adapter does not overwrite). Non-blocking
        from pinned host memory on CUDA (the caller orders the stream)."""
        if slot == 0:
            raise ValueError("slot 0 is the no-adapter slot")
        for dest, src in ((self.A[pool][slot], a), *((B[slot], b) for B, b in zip(self.B[pool], bs))):
            if src is None:
                dest.zero_()
            elif isinstance(src, torch.Tensor):
                if src.shape != dest.shape:
                    raise InvalidAdapterWeightsError(f"stack {tuple(src.shape)} for a slot of {tuple(dest.shape)}")
                dest.copy_(src, non_blocking=True)
            else:  # a stack still in its image file (`FileStack`)
                src.read_into(dest)

    def apply(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """y += the adapter deltas of every row (in place; y is the group's fused base output)."""
        n_mod = len(self.modules)
        T = x.shape[0]
        for pb in batch.pools:
            A, Bs, r = self.A[pb.pool], self.B[pb.pool], self.ranks[pb.pool]
            if pb.mode == "whole":  # one adapter: two thin matmuls, no gather
                h = x @ A[pb.first_slot].T  # [T, n*r]
                for m in range(n_mod):
                    ys = y[:, self.offsets[m] : self.offsets[m] + self.d[m]]
                    ys.addmm_(h[:, m * r : (m + 1) * r], Bs[m][pb.first_slot])
                continue
            if pb.mode == "dense":  # a range of slots at once, each token keeps only its own
                W = pb.width
                a = A.narrow(0, pb.lo, W).reshape(W * n_mod * r, self.k)
                h = (x @ a.T).view(T, W, n_mod, r)
                # where, not a 0/1 product: an inf of another slot becomes 0, never 0 * inf = NaN
                h = torch.where(pb.mask.view(T, W, 1, 1), h, h.new_zeros(()))
                for m in range(n_mod):
                    ys = y[:, self.offsets[m] : self.offsets[m] + self.d[m]]
                    ys.addmm_(h[:, :, m, :].reshape(T, W * r), Bs[m].narrow(0, pb.lo, W).reshape(W * r, self.d[m]))
                continue
            if pb.mode == "invariant":  # per row, whatever the batch: one [1, k] product per token
                xs = x.index_select(0, pb.out_index).unsqueeze(1)  # [U, 1, k]
                h = torch.bmm(xs, A.index_select(0, pb.seg_slots).transpose(1, 2))  # [U, 1, n*r]
                for m in range(n_mod):
                    out = torch.bmm(h[:, :, m * r : (m + 1) * r], Bs[m].index_select(0, pb.seg_slots))
                    ys = y[:, self.offsets[m] : self.offsets[m] + self.d[m]]
                    ys.index_add_(0, pb.out_index, out.view(-1, self.d[m]))
                continue
            xs = x.unsqueeze(1) if pb.mode == "rows" else x[pb.gather]  # [U, L, k]
            U, L = xs.shape[0], xs.shape[1]
            copied = pb.seg_slots is not None
            if copied:
                h = torch.bmm(xs, A.index_select(0, pb.seg_slots).transpose(1, 2))  # shrink: [U, L, n*r]
            else:
                h = xs.new_empty((U, L, n_mod * r))
                for u0, u1, s, step in pb.runs:  # in place: a view of consecutive slots, or one slot
                    if step:
                        torch.bmm(xs[u0:u1], A[s : s + u1 - u0].transpose(1, 2), out=h[u0:u1])
                    else:
                        torch.mm(xs[u0:u1].reshape(-1, self.k), A[s].T, out=h[u0:u1].view(-1, n_mod * r))
            for m in range(n_mod):
                hm = h[:, :, m * r : (m + 1) * r]
                dm = self.d[m]
                if copied:
                    out = torch.bmm(hm, Bs[m].index_select(0, pb.seg_slots))  # expand: [U, L, d_m]
                else:
                    out = xs.new_empty((U, L, dm))
                    for u0, u1, s, step in pb.runs:
                        if step:
                            torch.bmm(hm[u0:u1], Bs[m][s : s + u1 - u0], out=out[u0:u1])
                        else:
                            torch.mm(hm[u0:u1].reshape(-1, r), Bs[m][s], out=out[u0:u1].view(-1, dm))
                ys = y[:, self.offsets[m] : self.offsets[m] + dm]
                if pb.mode == "rows":
                    ys.add_(out.view(T, dm))
                else:
                    flat = out.view(-1, dm)
                    if pb.valid is not None:
                        flat = flat.index_select(0, pb.valid)
                    ys.index_add_(0, pb.out_index, flat)


# ------------------------------------------------------------------------------------ whole model


def parse_peft_weights(
    weights: Mapping[str, torch.Tensor], config: ModelConfig, peaks: dict | None = None
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """PEFT tensor names -> {(layer, module): {"A": [r, k], "B": [d, r]}}; strict about everything else.
    `peaks`, when given, receives max |x| of each tensor as {(layer, module, "A" | "B"): float}."""
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in weights.items():
        m = _PEFT_KEY.search(name)
        if m is None:
            raise InvalidAdapterWeightsError(f"unsupported adapter tensor {name!r} (only lora_A/lora_B of {', '.join(LORA_MODULES)})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= config.num_layers:
            raise InvalidAdapterWeightsError(f"{name}: layer {layer} but the base has {config.num_layers}")
        slot = out.setdefault((layer, module), {})
        if which in slot:
            raise InvalidAdapterWeightsError(f"{name}: duplicate lora_{which} for layer {layer} {module}")
        if not t.is_floating_point():
            raise InvalidAdapterWeightsError(f"{name}: dtype {t.dtype} is not a floating point type")
        peak = abs_peak(t)
        if not math.isfinite(peak):
            # a NaN or inf in any slot would leak into other rows through the dense kernel (0 * inf)
            raise InvalidAdapterWeightsError(f"{name}: holds NaN or infinite values")
        if peaks is not None:
            peaks[(layer, module, which)] = peak
        slot[which] = t
    for (layer, module), ab in out.items():
        if set(ab) != {"A", "B"}:
            raise InvalidAdapterWeightsError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        d, k = config.module_shape(module)
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape[0] != d or b.shape[1] != a.shape[0]:
            raise InvalidAdapterWeightsError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit W [{d}, {k}]"
            )
    return out


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


@dataclass
class SlotImage:
    """An adapter already in the slot layout of one rank pool, ready for `ModelLoRA.write_image`.

    tensors["{layer}.{group}.A"]    [n_mod * r_p, k]: module m's A at rows m*r_p .. m*r_p + r, zeros past r
    tensors["{layer}.{group}.B{m}"] [r_p, d_m]:       (scale * B_m).T, zero rows past r
    in the stack dtype (pinned host memory on CUDA). A group (or a module's B) the adapter does not
    adapt has no entry: mounting zeroes those stacks. Built once when the adapter enters host RAM,
    so a mount is one copy per stack: no padding, transposing, scaling or casting on the way.
    """

    pool_rank: int
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @contextlib.contextmanager
    def sources(self):
        """key -> what `write_slot` copies from (here the tensors themselves)."""
        yield self.tensors


def pread_into(fd: int, dest: torch.Tensor, offset: int) -> int:
    """Read file bytes from `offset` into contiguous host tensor `dest` until it is full or the file
    ends; returns the bytes read."""
    view, got = memoryview(dest.view(-1).view(torch.uint8).numpy()), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


@dataclass
class FileStack:
    """One stack of a `SlotImageFile`: `nbytes` at `offset` of an open file, in the slot dtype."""

    fd: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]

    def read_into(self, dest: torch.Tensor) -> None:
        """Read the bytes straight into `dest` when it is contiguous host memory (one copy, from the
        page cache), else through a staging buffer (pinned for a device) and one copy."""
        if tuple(dest.shape) != self.shape or dest.numel() * dest.element_size() != self.nbytes:
            raise InvalidAdapterWeightsError(f"image stack {self.shape} for a slot of {tuple(dest.shape)}")
        direct = dest.device.type == "cpu" and dest.is_contiguous()
        stage = dest if direct else torch.empty(self.shape, dtype=dest.dtype, pin_memory=dest.device.type == "cuda")
        got = pread_into(self.fd, stage, self.offset)
        if got < self.nbytes:
            raise InvalidAdapterWeightsError(f"slot image truncated at byte {self.offset + got}")
        if not direct:
            dest.copy_(stage, non_blocking=True)


@dataclass
class SlotImageFile(SlotImage):
    """A `SlotImage` still in the safetensors file it was saved to (the disk tier): only its header
    has been read. Mounting reads each stack from the file straight into the slot, so disk -> slot
    is one read; `tensors` stays empty. entries: key -> (file offset, nbytes, shape)."""

    path: Path | None = None
    entries: dict[str, tuple[int, int, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.entries.values())

    @contextlib.contextmanager
    def sources(self):
        with open(self.path, "rb", buffering=0) as f:
            yield {k: FileStack(f.fileno(), off, n, shape) for k, (off, n, shape) in self.entries.items()}


def abs_peak(t: torch.Tensor) -> float:
    """max |x| over `t` (0.0 when empty; NaN if it holds one, inf if it holds one): min and max in one
    pass, ~20x faster on CPU than materialising `isfinite(t)`, for the checks every load runs."""
    if t.numel() == 0:
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(t))
    if math.isnan(lo) or math.isnan(hi):
        return math.nan
    return max(-lo, hi)


def image_key(layer: int, group: str, which: str) -> str:
    return f"{layer}.{group}.{which}"


class ModelLoRA:
    """All multi-LoRA layers of a runner, the rank pools, and slot numbering.

    Global slots: 0 = no adapter; 1.. number the slots of every pool in pool order (pools sorted by
    rank). `pool_of(slot)` gives (pool index, local slot). Slot bookkeeping (which adapter sits where)
    belongs to the engine; this class only moves weights and builds per-step metadata.
    """

    def __init__(self, config: ModelConfig, rank_pools: Mapping[int, int], dtype: torch.dtype, device: torch.device):
        if not rank_pools:
            raise ValueError("rank_pools is empty")
        for r, s in rank_pools.items():
            if int(r) < 1 or int(s) < 0:
                raise ValueError(f"bad rank pool {r}: {s}")
        self.config = config
        self.pools: list[tuple[int, int]] = sorted((int(r), int(s)) for r, s in rank_pools.items())
        self.dtype, self.device = dtype, device
        self._base: list[int] = []  # global slot of each pool's local slot 1, minus 1
        g = 0
        for _, s in self.pools:
            self._base.append(g)
            g += s
        self.num_slots = g
        self._slot_map: list[tuple[int, int]] = [(-1, 0)]  # global slot -> (pool, local)
        for i, (_, s) in enumerate(self.pools):
            self._slot_map.extend((i, j) for j in range(1, s + 1))
        self.layers: list[dict[str, MultiLoRALinear]] = []
        for _ in range(config.num_layers):
            groups = {}
            for gname, mods in GROUPS.items():
                k = config.module_shape(mods[0])[1]
                layer = MultiLoRALinear(mods, k, [config.module_shape(m)[0] for m in mods])
                layer.create_lora_weights(self.pools, dtype, device)
                groups[gname] = layer
            self.layers.append(groups)
        # per-slot weight values of each pool over the whole model, for the kernel-choice estimate
        self._slot_values = [
            sum(len(g.modules) * r * g.k + r * sum(g.d) for groups in self.layers for g in groups.values())
            for r, _ in self.pools
        ]
        self._num_groups = config.num_layers * len(GROUPS)
        self._num_modules = config.num_layers * len(LORA_MODULES)
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    # -- slots
    def pool_index_for_rank(self, rank: int) -> int:
        for i, (r, s) in enumerate(self.pools):
            if r >= rank and s > 0:
                return i
        raise ValueError(f"rank {rank} exceeds the largest rank pool ({self.pools[-1][0]})")

    def pool_rank_for(self, rank: int) -> int:
        return self.pools[self.pool_index_for_rank(rank)][0]

    def pool_of(self, slot: int) -> tuple[int, int]:
        if not 0 < slot < len(self._slot_map):
            raise ValueError(f"slot {slot} out of range")
        return self._slot_map[slot]

    def slots_of_pool(self, pool: int) -> range:
        return range(self._base[pool] + 1, self._base[pool] + self.pools[pool][1] + 1)

    # -- weights
    def set_adapter(
        self,
        slot: int,
        weights: Mapping[str, torch.Tensor],
        rank: int,
        alpha: float,
        target_modules: Iterable[str] | None = None,
        use_rslora: bool = False,
    ) -> None:
        """Validate PEFT-named tensors and write them into `slot` (the pool must fit `rank`)."""
        pool, _ = self.pool_of(slot)
        image = self.build_image(weights, rank, alpha, target_modules, use_rslora, pool_rank=self.pools[pool][0])
        self.write_image(slot, image)

    def build_image(
        self,
        weights: Mapping[str, torch.Tensor],
        rank: int,
        alpha: float,
        target_modules: Iterable[str] | None = None,
        use_rslora: bool = False,
        *,
        pool_rank: int | None = None,
        pin_memory: bool = False,
    ) -> SlotImage:
        """Validate PEFT-named tensors and lay them out for a slot of the pool that fits `rank` (or of
        `pool_rank`): see `SlotImage`. Host memory (pinned with `pin_memory`); nothing is mounted."""
        r_p = self.pool_rank_for(rank) if pool_rank is None else int(pool_rank)
        peaks: dict = {}
        parsed = parse_peft_weights(weights, self.config, peaks)
        if not parsed:
            raise InvalidAdapterWeightsError("the adapter holds no LoRA tensors")
        targets = None if target_modules is None else set(target_modules)
        if targets is not None:
            unknown = targets - set(LORA_MODULES)
            if unknown:
                raise InvalidAdapterWeightsError(f"unsupported target modules: {sorted(unknown)}")
        for (layer, module), ab in parsed.items():
            r = ab["A"].shape[0]
            if r > r_p or r > rank:
                raise InvalidAdapterWeightsError(f"layer {layer} {module}: rank {r} exceeds the declared rank {rank}")
            if targets is not None and module not in targets:
                raise InvalidAdapterWeightsError(f"tensors for {module}, which is not in target_modules")
        tensors: dict[str, torch.Tensor] = {}
        limit = float(torch.finfo(self.dtype).max)

        def empty(shape, full: bool) -> torch.Tensor:
            make = torch.empty if full else torch.zeros
            return make(shape, dtype=self.dtype, pin_memory=pin_memory)

        for li, groups in enumerate(self.layers):
            for gname, layer in groups.items():
                present = [(m, parsed[(li, name)]) for m, name in enumerate(layer.modules) if (li, name) in parsed]
                if not present:
                    continue
                full = len(present) == len(layer.modules) and all(ab["A"].shape[0] == r_p for _, ab in present)
                A = empty((len(layer.modules) * r_p, layer.k), full)
                for m, ab in present:
                    r = ab["A"].shape[0]
                    name = layer.modules[m]
                    scale = float(lora_scale(alpha, r, use_rslora))
                    # A, or scale * B, past the slot dtype's range (65,504 in float16): from the peaks
                    # parse measured (a value <= max never rounds to inf), no second pass over the output
                    if peaks[(li, name, "A")] > limit or peaks[(li, name, "B")] * scale > limit:
                        raise InvalidAdapterWeightsError(f"scaled weights overflow {self.dtype} (layer {li})")
                    A[m * r_p : m * r_p + r].copy_(ab["A"])
                    B = empty((r_p, layer.d[m]), r == r_p)
                    if ab["B"].dtype in (self.dtype, torch.float32):
                        # one strided pass; computed in float32 and rounded once, as the fallback
                        torch.mul(ab["B"].T, scale, out=B[:r])
                    else:  # e.g. float16 in, bfloat16 slots: scale in float32, not in the input dtype
                        B[:r].copy_((ab["B"].to(torch.float32) * scale).T)
                    tensors[image_key(li, gname, f"B{m}")] = B
                tensors[image_key(li, gname, "A")] = A
        return SlotImage(r_p, self.dtype, tensors)

    def write_image(self, slot: int, image: SlotImage) -> None:
        """Mount a `SlotImage` into `slot`: one copy per stack, zeroing only the stacks it has no
        entry for (every row of an entry is written, padding included). A `SlotImageFile` is read
        from its file straight into the slot's stacks."""
        pool, local = self.pool_of(slot)
        if image.pool_rank != self.pools[pool][0] or image.dtype != self.dtype:
            raise InvalidAdapterWeightsError(
                f"image for a rank-{image.pool_rank} {image.dtype} slot, slot {slot} is rank "
                f"{self.pools[pool][0]} {self.dtype}")
        with image.sources() as t:
            for li, groups in enumerate(self.layers):
                for gname, layer in groups.items():
                    layer.write_slot(pool, local, t.get(image_key(li, gname, "A")),
                                     [t.get(image_key(li, gname, f"B{m}")) for m in range(len(layer.modules))])

    def reset_adapter(self, slot: int) -> None:
        pool, local = self.pool_of(slot)
        for groups in self.layers:
            for layer in groups.values():
                layer.reset_lora(pool, local)

    # -- per step
    kernel = "auto"  # default `mode` of prepare(); "segments", "gather", "dense" or "invariant" force one kernel

    def estimate(self, pool: int, kernel: str, tokens: int, segments: int, seg_len: int, runs: int, width: int) -> float:
        """Estimated seconds of one step's LoRA work in `pool` for every layer (see `KernelCosts`).

        Per slot the model holds P values (all layers and groups); G products groups and M modules:
          dense:    width*P read, tokens*width*P MACs, 2G + M calls;
          segments: U*P read, U*L*P MACs, runs*(G + M) + 2G + M calls;
          gather:   U*P copied then read, U*L*P MACs, 3G + 3M calls."""
        c = kernel_costs(self.device, self.dtype)
        P, G, M = self._slot_values[pool], self._num_groups, self._num_modules
        es = self._itemsize
        if kernel == "dense":
            return (2 * G + M) * c.call_s + width * P * es / c.read_bps + tokens * width * P / c.macs_per_s
        work = segments * P * es / c.read_bps + segments * seg_len * P / c.macs_per_s
        if kernel == "segments":
            return (runs * (G + M) + 2 * G + M) * c.call_s + work
        return (3 * G + 3 * M) * c.call_s + work + segments * P * es / c.copy_bps

    def prepare(self, slot_of_token: list[int], prefill: bool = True, mode: str | None = None) -> LoRABatch | None:
        """Kernel choice and segment metadata for a step whose flat tokens carry these global slots
        (0 = none). Built once per step and shared by every layer. `mode` forces "segments" (SGMV /
        BGMV reading the stacks in place), "gather" (the same with copied stacks) or "dense" for
        tests and benchmarks; "auto" picks, per pool, the cheapest by `estimate` with this device's
        measured constants."""
        mode = mode or self.kernel
        if mode not in ("auto", "segments", "gather", "dense", "invariant"):
            raise ValueError(f"unknown LoRA kernel mode {mode!r}")
        T = len(slot_of_token)
        by_pool: dict[int, dict[int, list[int]]] = {}
        for i, s in enumerate(slot_of_token):
            if s:
                pool, local = self._slot_map[s]
                by_pool.setdefault(pool, {}).setdefault(local, []).append(i)
        if not by_pool:
            return None
        pools = []
        dev = self.device
        if mode == "invariant":  # every token alone: the same products whatever the batch holds
            for pool in sorted(by_pool):
                idx = [i for i, s in enumerate(slot_of_token) if s and self._slot_map[s][0] == pool]
                local = [self._slot_map[slot_of_token[i]][1] for i in idx]
                pools.append(PoolBatch(pool, "invariant", num_segments=len(idx),
                                       seg_slots=to_device(torch.tensor(local, dtype=torch.long), dev),
                                       out_index=to_device(torch.tensor(idx, dtype=torch.long), dev)))
            return LoRABatch(pools)
        for pool, segs in sorted(by_pool.items()):
            r = self.pools[pool][0]
            n = sum(len(v) for v in segs.values())
            if len(segs) == 1 and n == T and mode != "dense":
                (local,) = segs
                pools.append(PoolBatch(pool, "whole", first_slot=local, num_segments=1, seg_len=T))
                continue
            L = _plan_segments([len(v) for v in segs.values()], r)
            rows_mode = L == 1 and n == T
            if rows_mode:  # BGMV: one segment per token, in token order
                seg_slots = [self._slot_map[s][1] for s in slot_of_token]
                rows = [[i] for i in range(T)]
            else:  # SGMV: segments of up to L tokens of one slot, in slot order
                seg_slots, rows = [], []
                for local, idx in sorted(segs.items()):
                    for j in range(0, len(idx), L):
                        seg_slots.append(local)
                        rows.append(idx[j : j + L])
            U = len(rows)
            runs = _runs(seg_slots)
            lo = min(segs)
            width = max(segs) - lo + 1
            kernel = mode
            if mode == "auto":
                kernel = min(("segments", "dense", "gather"),
                             key=lambda kn: self.estimate(pool, kn, T, U, L, len(runs), width))
            if kernel == "dense":
                mask = torch.zeros((T, width), dtype=torch.bool)
                for local, idx in segs.items():
                    mask[idx, local - lo] = True
                pools.append(PoolBatch(pool, "dense", mask=to_device(mask, dev), lo=lo, width=width))
                continue
            copied = to_device(torch.tensor(seg_slots, dtype=torch.long), dev) if kernel == "gather" else None
            if rows_mode:
                pools.append(PoolBatch(pool, "rows", seg_slots[0], U, 1, runs, copied))
                continue
            gather = torch.zeros((U, L), dtype=torch.long)
            valid_pos: list[int] = []
            out_index: list[int] = []
            for u, idx in enumerate(rows):
                gather[u, : len(idx)] = torch.tensor(idx)
                gather[u, len(idx) :] = idx[0]
                valid_pos.extend(range(u * L, u * L + len(idx)))
                out_index.extend(idx)
            padded = len(valid_pos) != U * L
            pools.append(
                PoolBatch(
                    pool, "gather", seg_slots[0], U, L, runs, copied,
                    gather=to_device(gather, dev),
                    out_index=to_device(torch.tensor(out_index, dtype=torch.long), dev),
                    valid=to_device(torch.tensor(valid_pos, dtype=torch.long), dev) if padded else None,
                )
            )
        return LoRABatch(pools)

    def apply(self, layer: int, modules: tuple[str, ...], x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        self.layers[layer][GROUP_OF_MODULES[modules]].apply(x, y, batch)


@dataclass
class PeftAdapter:
    """An adapter read from a PEFT folder: what `Engine.mount_adapter` takes."""

    weights: dict[str, torch.Tensor]
    rank: int
    alpha: float
    target_modules: list[str]
    use_rslora: bool


def read_peft_adapter(path) -> PeftAdapter:
    """Read `adapter_config.json` + `adapter_model.safetensors` (safetensors only: never pickle)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(path)
    cfg = json.loads((d / "adapter_config.json").read_text())
    weights = load_file(str(d / "adapter_model.safetensors"), device="cpu")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = sorted({m for m in LORA_MODULES if re.search(targets, m)})
    return PeftAdapter(weights, int(cfg["r"]), float(cfg["lora_alpha"]), list(targets), bool(cfg.get("use_rslora", False)))


def _main(argv=None) -> int:
    """`python -m handler.model.lora calibrate FILE [--device cuda] [--dtype bfloat16]`: time the kernel-choice
    constants on this (idle) machine and store them in FILE (merged with what it holds) for
    $LORAFARM_KERNEL_COSTS. Replicas read the file; they never time anything at start-up."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m handler.model.lora")
    ap.add_argument("command", choices=["calibrate"])
    ap.add_argument("file", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    c = calibrate(torch.device(a.device), dtype)
    table = json.loads(a.file.read_text()) if a.file.exists() else {}
    table[f"{torch.device(a.device).type}/{a.dtype}"] = [c.call_s, c.read_bps, c.copy_bps, c.macs_per_s]
    a.file.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{a.file}: {torch.device(a.device).type}/{a.dtype} = {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
