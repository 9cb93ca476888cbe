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
    is one long segment); segments are padded to a common length L and run as one `torch.bmm` over
    [segments, L, k] against the gathered A[seg_slots], then B[seg_slots].
  * BGMV (batched gather matrix-vector): the L = 1 case, one segment per row, used for decode
    batches of many distinct adapters: A and B are gathered per row and multiplied with one bmm.
  * Dense: for a decode-sized step that uses most of a pool, one matmul against all of the pool's
    slots (x @ A_all.T), a per-token slot mask, one matmul against all B: no gathered copies, which
    is cheaper than gathering when the pool is mostly active.
  * A single adapter over the whole batch is one segment without any gather (two thin matmuls).
  * Segments on consecutive slots (the engine orders decode rows by slot) read the stacks through
    a view (`narrow`) instead of a gathered copy.
The segment length and the kernel are chosen per step by a small traffic estimate.

Adapters with NaN or infinite values are rejected at `set_adapter`: the dense kernel multiplies
every slot of a pool by a 0/1 mask, and 0 * inf would leak into other rows.

Layer contract (after vLLM's `lora/layers/base.py`):
  `MultiLoRALinear.create_lora_weights(pools, dtype, device)`, `.set_lora(pool, slot, a, b, scale)`,
  `.reset_lora(pool, slot)`, `.apply(x, y, batch)`.
One `MultiLoRALinear` covers the modules that share an input (q/k/v, gate/up, o, down): their A
matrices are stacked so the shrink `x @ A.T` is one product for the group; B is stored transposed
and scaled at `set_lora` time (B'.T = scale * B.T), which is the formula above with the scalar
moved into the stored weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from handler.model import LORA_MODULES, ModelConfig

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
    mode "rows":   BGMV, one segment per token, tokens in order (seg_slots[i] is token i's slot);
    mode "gather": SGMV, segments of up to `seg_len` tokens of one slot, padded; `gather` [U, L]
                   holds token indices, `out_index` the token of every valid position and `valid`
                   (None without padding) those positions in the flattened [U*L];
    mode "dense":  every slot of the pool at once: `mask` [T, S+1] picks each token's slot.
    """

    pool: int
    seg_slots: torch.Tensor | None  # [U] local slot per segment (device)
    first_slot: int
    num_segments: int
    seg_len: int
    mode: str
    gather: torch.Tensor | None = None
    out_index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    contiguous: bool = False  # seg_slots == first_slot, first_slot + 1, ...: the stacks are sliced, not gathered


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
        self.A = [torch.zeros((s + 1, n * r, self.k), dtype=dtype, device=device) for r, s in pools]
        self.B = [[torch.zeros((s + 1, r, d), dtype=dtype, device=device) for d in self.d] for r, s in pools]

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
            if pb.mode == "dense":  # all slots of the pool, each token masked to its own
                S1 = A.shape[0]
                h = (x @ A.view(-1, self.k).T).view(T, S1, n_mod, r) * pb.mask.view(T, S1, 1, 1)
                for m in range(n_mod):
                    ys = y[:, self.offsets[m] : self.offsets[m] + self.d[m]]
                    ys.addmm_(h[:, :, m, :].reshape(T, S1 * r), Bs[m].view(S1 * r, self.d[m]))
                continue
            if pb.contiguous:  # segments on consecutive slots: a view of the stack, no gathered copy
                lo, U = pb.first_slot, pb.num_segments
                a = A.narrow(0, lo, U)
                bs = [B.narrow(0, lo, U) for B in Bs]
            else:
                a = A.index_select(0, pb.seg_slots)  # [U, n*r, k]
                bs = [B.index_select(0, pb.seg_slots) for B in Bs]  # [U, r, d_m]
            xs = x.unsqueeze(1) if pb.mode == "rows" else x[pb.gather]  # [U, L, k]
            h = torch.bmm(xs, a.transpose(1, 2))  # shrink: [U, L, n*r]
            for m in range(n_mod):
                out = torch.bmm(h[:, :, m * r : (m + 1) * r], bs[m])  # expand: [U, L, d_m]
                ys = y[:, self.offsets[m] : self.offsets[m] + self.d[m]]
                if pb.mode == "rows":
                    ys.add_(out.view(T, self.d[m]))
                else:
                    flat = out.view(-1, self.d[m])
                    if pb.valid is not None:
                        flat = flat.index_select(0, pb.valid)
                    ys.index_add_(0, pb.out_index, flat)


# ------------------------------------------------------------------------------------ whole model


def parse_peft_weights(
    weights: Mapping[str, torch.Tensor], config: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """PEFT tensor names -> {(layer, module): {"A": [r, k], "B": [d, r]}}; strict about everything else."""
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
        if not bool(torch.isfinite(t).all()):
            # a NaN or inf in any slot would leak into other rows through the dense kernel (0 * inf)
            raise InvalidAdapterWeightsError(f"{name}: holds NaN or infinite values")
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
        pool, local = self.pool_of(slot)
        r_p = self.pools[pool][0]
        parsed = parse_peft_weights(weights, self.config)
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
        for li, groups in enumerate(self.layers):
            for layer in groups.values():
                a, b, sc = {}, {}, {}
                for m in layer.modules:
                    ab = parsed.get((li, m))
                    if ab is None:
                        continue
                    r = ab["A"].shape[0]
                    a[m] = ab["A"].to(self.device, self.dtype)
                    b[m] = ab["B"].to(self.device, torch.float32)
                    sc[m] = lora_scale(alpha, r, use_rslora)
                layer.set_lora(pool, local, a, b, sc)
                if self.dtype == torch.float16 and not all(  # scale * B can overflow float16 only
                    bool(torch.isfinite(t[local]).all()) for t in [layer.A[pool], *layer.B[pool]]
                ):
                    self.reset_adapter(slot)
                    raise InvalidAdapterWeightsError(f"scaled weights overflow {self.dtype} (layer {li})")

    def reset_adapter(self, slot: int) -> None:
        pool, local = self.pool_of(slot)
        for groups in self.layers:
            for layer in groups.values():
                layer.reset_lora(pool, local)

    # -- per step
    DENSE_MAX_TOKENS = 128

    kernel = "auto"  # default `mode` of prepare(); "segments" or "dense" force one kernel everywhere

    def prepare(self, slot_of_token: list[int], prefill: bool = True, mode: str | None = None) -> LoRABatch | None:
        """Kernel choice and segment metadata for a step whose flat tokens carry these global slots
        (0 = none). Built once per step and shared by every layer. `mode` forces "segments" (SGMV /
        BGMV) or "dense" for tests and benchmarks; "auto" picks per pool by a traffic estimate:
        gathering U segments moves about 3 x U slots of weights (read, write, read), the dense
        kernel reads all S + 1 slots of the pool once but multiplies every token by every slot."""
        mode = mode or self.kernel
        if mode not in ("auto", "segments", "dense"):
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
        for pool, segs in sorted(by_pool.items()):
            r, S = self.pools[pool]
            n = sum(len(v) for v in segs.values())
            if len(segs) == 1 and n == T and mode != "dense":
                (local,) = segs
                pools.append(PoolBatch(pool, None, local, 1, T, "whole"))
                continue
            L = _plan_segments([len(v) for v in segs.values()], r)
            nseg = sum(-(-len(v) // L) for v in segs.values())
            # segments over consecutive slots are read as a view (no copy): always the cheapest
            if L == 1:
                locals_in_order = [self._slot_map[s][1] for s in slot_of_token if s and self._slot_map[s][0] == pool]
                consecutive = locals_in_order == list(range(locals_in_order[0], locals_in_order[0] + n))
            else:
                consecutive = L == max(len(v) for v in segs.values()) and sorted(segs) == list(
                    range(min(segs), min(segs) + len(segs))
                )
            dense = mode == "dense" or (
                mode == "auto" and not consecutive and T <= self.DENSE_MAX_TOKENS and (S + 1) < 3 * nseg
            )
            if dense:
                mask = torch.zeros((T, S + 1), dtype=self.dtype)
                for local, idx in segs.items():
                    mask[idx, local] = 1
                pools.append(PoolBatch(pool, None, 0, 0, 0, "dense", mask=mask.to(dev)))
                continue
            seg_slots: list[int] = []
            rows: list[list[int]] = []
            if L == 1:  # BGMV: one segment per token, in token order
                for i, s in enumerate(slot_of_token):
                    if s and self._slot_map[s][0] == pool:
                        seg_slots.append(self._slot_map[s][1])
                        rows.append([i])
            else:  # SGMV: segments of up to L tokens of one slot, in slot order
                for local, idx in sorted(segs.items()):
                    for j in range(0, len(idx), L):
                        seg_slots.append(local)
                        rows.append(idx[j : j + L])
            U = len(rows)
            slots_t = torch.tensor(seg_slots, dtype=torch.long, device=dev)
            contiguous = seg_slots == list(range(seg_slots[0], seg_slots[0] + U))
            if L == 1 and n == T:
                pools.append(PoolBatch(pool, slots_t, seg_slots[0], U, 1, "rows", contiguous=contiguous))
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
                    pool,
                    slots_t,
                    seg_slots[0],
                    U,
                    L,
                    "gather",
                    gather=gather.to(dev),
                    out_index=torch.tensor(out_index, dtype=torch.long, device=dev),
                    valid=torch.tensor(valid_pos, dtype=torch.long, device=dev) if padded else None,
                    contiguous=contiguous,
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
