"""One adapted layer at 7B dims: the base product alone vs ours (1, 8, 32 distinct adapters) vs a
per-adapter loop (PEFT's mixed-batch approach) vs merged weights.

Shapes: k = 4096 in; d = 4096 (an attention projection) and 11008 (an MLP up/gate projection);
rank 16; 32 decode rows; float32 and bfloat16. Our layer holds a rank-16 pool of 64 slots with 32
random adapters on scattered slots (a seeded random half, as LRU leaves them); rows are ordered by
slot as the engine orders decode rows. "ours" = base product + `MultiLoRALinear.apply` with the
kernel the engine would pick ("auto", from this device's measured costs for this layer);
"ours-seg" forces SGMV/BGMV reading the stacks in place, "ours-dense" the masked dense product and
"ours-gather" SGMV/BGMV on copied (index_select) stacks. The per-step metadata
(`ModelLoRA.prepare`) is built once per step for all layers of the model, so it is timed apart.

The loop is PEFT's `_mixed_batch_forward`: for each adapter in the batch, slice its rows, run
lora_B(lora_A(x)) * scaling, add into the result rows (index lists precomputed, in PEFT's favour).

    make bench PYTEST_ARGS='-k lora_layer'
    # or: .venv/bin/python -m pytest benchmarks/bench_lora_layer.py --benchmark-only --benchmark-enable
"""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from benchmarks.conftest import stats_of
from handler.model.lora import ModelLoRA, MultiLoRALinear
from handler.model.runner import ModelConfig

SUITE = "lora_layer"
K, RANK, ROWS, SLOTS, ADAPTERS = 4096, 16, 32, 64, 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ["base", "merged", "ours-1", "ours-8", "ours-32", "ours-seg-8", "ours-seg-32", "ours-dense-32",
            "ours-gather-32", "loop-1", "loop-8", "loop-32"]
SCATTERED = sorted(random.Random(0).sample(range(1, SLOTS + 1), ADAPTERS))  # the adapters' slots


def _cfg() -> ModelConfig:  # only the pool layout matters for the step metadata
    return ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=8,
                       sliding_windows=(None,))


class LayerCase:
    def __init__(self, d: int, dtype: torch.dtype, device: str):
        g = torch.Generator().manual_seed(d)
        self.device = torch.device(device)
        self.W = (torch.randn(d, K, generator=g) * 0.02).to(self.device, dtype)
        self.x = torch.randn(ROWS, K, generator=g).to(self.device, dtype)
        self.A = [(torch.randn(RANK, K, generator=g) / K**0.5).to(self.device, dtype) for _ in range(SLOTS)]
        self.B = [(torch.randn(d, RANK, generator=g) * 0.01).to(self.device, dtype) for _ in range(SLOTS)]
        self.scale = 2.0
        self.layer = MultiLoRALinear(("up_proj",), K, [d])
        self.layer.create_lora_weights([(RANK, SLOTS)], dtype, self.device)
        for s in SCATTERED:
            self.layer.set_lora(0, s, {"up_proj": self.A[s - 1]}, {"up_proj": self.B[s - 1]}, {"up_proj": self.scale})
        self.meta = ModelLoRA(_cfg(), {RANK: SLOTS}, dtype, self.device)
        # the kernel-choice estimate for this one layer (the meta's own config is a stub)
        self.meta._slot_values, self.meta._num_groups, self.meta._num_modules = [RANK * (K + d)], 1, 1
        s0 = SCATTERED[0] - 1
        self.W_merged = self.W + self.scale * (self.B[s0].float() @ self.A[s0].float()).to(dtype)
        self.lora_A = [torch.nn.Linear(K, RANK, bias=False, device=self.device, dtype=dtype) for _ in range(SLOTS)]
        self.lora_B = [torch.nn.Linear(RANK, d, bias=False, device=self.device, dtype=dtype) for _ in range(SLOTS)]
        with torch.no_grad():
            for s in range(SLOTS):
                self.lora_A[s].weight.copy_(self.A[s])
                self.lora_B[s].weight.copy_(self.B[s])

    @staticmethod
    def slots(distinct: int) -> list[int]:
        return sorted(SCATTERED[i % distinct] for i in range(ROWS))  # ordered by slot, as the engine does

    def fn(self, variant: str):
        x, W = self.x, self.W
        if variant == "base":
            return lambda: F.linear(x, W)
        if variant == "merged":
            Wm = self.W_merged
            return lambda: F.linear(x, Wm)
        if variant.startswith("ours"):
            distinct = int(variant.rsplit("-", 1)[1])
            mode = next((m for k, m in (("seg", "segments"), ("dense", "dense"), ("gather", "gather")) if k in variant),
                        "auto")
            batch = self.meta.prepare(self.slots(distinct), prefill=False, mode=mode)
            layer = self.layer

            def ours():
                y = F.linear(x, W)
                layer.apply(x, y, batch)
                return y

            return ours
        distinct = int(variant.rsplit("-", 1)[1])
        slots = self.slots(distinct)
        groups = [(s - 1, torch.tensor([i for i, t in enumerate(slots) if t == s], device=self.device))
                  for s in sorted(set(slots))]
        lora_A, lora_B, scale = self.lora_A, self.lora_B, self.scale

        def loop():  # PEFT LoraLayer._mixed_batch_forward
            result = F.linear(x, W)
            for a, idx in groups:
                sub = x[idx]
                result[idx] += lora_B[a](lora_A[a](sub)) * scale
            return result

        return loop


def interleaved(benchmark, fns: dict, rounds: int, inner: int, cuda: bool) -> dict[str, list[float]]:
    """Time every variant once per round, in a shuffled order, `rounds` times (after one warm-up
    round): on a shared or throttling machine, drift then hits all variants alike and ratios are
    taken per round (paired). pytest-benchmark times the whole round."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)

    def one_round(record: bool = True):
        rng.shuffle(names)
        for n in names:
            fn = fns[n]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            if cuda:
                torch.cuda.synchronize()
            if record:
                samples[n].append((time.perf_counter() - t0) / inner)

    one_round(record=False)
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    return samples


def summary(xs: list[float]) -> dict:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "mean_s": statistics.fmean(xs),
            "stddev_s": statistics.pstdev(xs), "rounds": len(xs), "samples": xs}


@pytest.mark.parametrize("d", [4096, 11008])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_lora_layer(benchmark, bench_report, dtype_name, d):
    device = bench_report.device
    cuda = device == "cuda"
    case = LayerCase(d, DTYPES[dtype_name], device)
    fns = {v: case.fn(v) for v in VARIANTS}
    with torch.inference_mode():
        for v in VARIANTS:  # like with like: ours computes what the per-adapter loop computes
            if v.startswith("ours"):
                ref = fns["loop-" + v.rsplit("-", 1)[1]]().float()
                got = fns[v]().float()
                assert ((got - ref).abs().max() / ref.abs().max()).item() < (1e-5 if dtype_name == "fp32" else 2e-2)
        benchmark.group = f"lora-layer {dtype_name} d={d} (one round = every variant once)"
        samples = interleaved(benchmark, fns, rounds=40 if cuda else 30, inner=100 if cuda else 1, cuda=cuda)
    for v, xs in samples.items():
        bench_report.add(SUITE, f"{dtype_name}/{d}/{v}", dtype=dtype_name, d=d, k=K, rank=RANK, rows=ROWS,
                         variant=v, **summary(xs))
    benchmark.extra_info.update({v: statistics.median(xs) for v, xs in samples.items()})


def test_step_metadata(benchmark, bench_report):
    """`ModelLoRA.prepare` for 32 decode rows on 32 distinct adapters: once per step, all layers."""
    meta = ModelLoRA(_cfg(), {RANK: SLOTS}, torch.float32, torch.device(bench_report.device))
    slots = LayerCase.slots(32)
    benchmark.group = "lora-layer metadata"
    benchmark.pedantic(lambda: meta.prepare(slots, prefill=False), rounds=50, iterations=1, warmup_rounds=3)
    bench_report.add(SUITE, "metadata/32", variant="metadata", **stats_of(benchmark))
