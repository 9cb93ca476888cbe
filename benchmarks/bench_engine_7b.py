"""The engine's decode step at Llama-2-7B layer dims, and one long row among short ones.

* 7B-shaped: a 2-layer Llama with Llama-2-7B layer dims (hidden 4096, MLP 11008, 32 heads, no
  GQA), batch 32 decode rows of 64-token contexts, float32 on CPU (bfloat16 in gpu_check.sh).
  A rank-16 pool of 64 slots holds 32 distinct adapters (all 7 projections) on scattered slots,
  as LRU leaves them (a seeded random half of the pool). Variants: no adapters; 1, 8, 32 distinct
  (row i on adapter i mod N); and the 32-distinct step with each LoRA kernel forced, to check
  that the measured kernel choice ("auto") is never far from the best. Byte floor of 32
  distinct: base weights / (base + 32 adapters) = 0.835.
* long row: the small dev model, 32 decode rows of 64-token contexts vs the same with one row at
  1,088 tokens; and that step with the rows padded to the longest in one group (the old layout).
Every variant runs with the gathered decode attention (bucketed rows, blocks copied out) and the
main ones also with the paged kernel (`handler.model.paged_attention`, read in place: "-paged") and with
the torch.compile'd layer pieces (`Runner.compile`: "-compiled"; compile time is not timed). Block
tables are scattered over the cache, as a long-running cache leaves them.

What is timed is the engine's forward step: step metadata (`build_step_batch` + LoRA `prepare`)
and `Runner.forward`, rows ordered by slot as the engine orders them; sampling (one argmax over
32 rows) and detokenization are left out. Rounds interleave every variant in shuffled order; ratios
are medians of per-round ratios.

    make bench PYTEST_ARGS='-k engine_7b'
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import ALPHA, BATCH, CACHE, MODULES, RANK, _small_model
from handler.model.kvcache import KVCache
from handler.model.lora import ModelLoRA
from handler.model.runner import Runner, build_step_batch
from handler.model.paged_attention import DecodeTables

SUITE = "engine_7b"
CTX, SLOTS = 64, 64
SHAPE_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                num_hidden_layers=2, vocab_size=512, max_position_embeddings=2048)


def seven_b_shaped(path: Path = CACHE / "model-7b-shaped-2l") -> Path:
    """A 2-layer checkpoint with Llama-2-7B layer dims and random bfloat16 weights (~0.8 GB)."""
    stamp = path / "lorafarm_7b_shaped.json"
    if stamp.exists() and json.loads(stamp.read_text()) == SHAPE_7B:
        return path
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**SHAPE_7B, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": w(v, h)}
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{m}.weight"] = w(h, h)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(i, h), w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(t, str(path / "model.safetensors"))
    stamp.write_text(json.dumps(SHAPE_7B))
    return path


def random_adapter(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(cfg.num_layers):
        for m in MODULES:
            d, k = cfg.module_shape(m)
            p = f"base_model.model.model.layers.{layer}.{'self_attn' if m in MODULES[:4] else 'mlp'}.{m}"
            out[p + ".lora_A.weight"] = torch.randn(RANK, k, generator=gen) / k**0.5
            out[p + ".lora_B.weight"] = torch.randn(d, RANK, generator=gen) * 0.02
    return out


class StepHarness:
    """A runner, a LoRA pool with adapters on scattered slots, and BATCH decode rows."""

    def __init__(self, model_dir: Path, device: str, dtype: torch.dtype, adapters: int, ctx: list[int]):
        self.runner = Runner(model_dir, dtype=dtype, device=device)
        cfg = self.runner.config
        self.device = self.runner.device
        self.lora = ModelLoRA(cfg, {RANK: SLOTS}, dtype, self.device)
        self.runner.lora = self.lora
        self.slots = sorted(random.Random(0).sample(range(1, SLOTS + 1), adapters))  # scattered, as LRU leaves them
        gen = torch.Generator().manual_seed(0)
        for s in self.slots:
            self.lora.set_adapter(s, random_adapter(cfg, gen), RANK, ALPHA, MODULES)
        self.block = 16
        per_row = [-(-c // self.block) for c in ctx]
        self.kv = KVCache.for_blocks(cfg, sum(per_row), self.block, dtype, self.device)
        free = list(range(self.kv.num_blocks))
        random.Random(2).shuffle(free)  # scattered blocks, as a long-running cache leaves them
        self.ctx, self.tables = ctx, [[free.pop() for _ in range(n)] for n in per_row]
        self.decode_tables = DecodeTables(self.kv, len(ctx))
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(3, cfg.vocab_size, (len(ctx),), generator=g).tolist()

    def step_fn(self, distinct: int | None, kernel: str = "auto", attention: str = "gather", compiled: bool = False):
        rows = list(range(len(self.ctx)))
        slot = [0 if distinct is None else self.slots[i % distinct] for i in rows]
        rows.sort(key=lambda i: slot[i])  # the engine orders decode rows by slot
        seqs = [([self.tokens[i]], self.ctx[i] - 1, self.tables[i]) for i in rows]
        slots = [slot[i] for i in rows]
        if compiled and self.runner.pieces is None:
            self.runner.compile()

        def step():
            batch = build_step_batch(seqs, self.block, self.device, self.runner.windows, decode_from=0,
                                     pad_block=self.kv.null_block,
                                     decode_tables=self.decode_tables if attention == "paged" else None,
                                     pad_to=len(seqs) if compiled else None,
                                     scratch_slot=self.kv.scratch_block * self.block)
            batch.lora = self.lora.prepare(slots, prefill=False, mode=kernel) if distinct else None
            return self.runner.forward(batch, self.kv)

        return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(benchmark, fns: dict, rounds: int, device) -> dict[str, list[float]]:
    names = list(fns)
    samples = {n: [] for n in names}
    rng = random.Random(0)

    def one_round(record=True):
        rng.shuffle(names)
        for n in names:
            _sync(device)
            t0 = time.perf_counter()
            fns[n]()
            _sync(device)
            if record:
                samples[n].append(time.perf_counter() - t0)

    one_round(record=False)
    one_round(record=False)
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    return samples


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _record(bench_report, samples: dict[str, list[float]]) -> None:
    """Tokens/s of BATCH rows per step, with the per-round samples for paired ratios."""
    for name, xs in samples.items():
        med = statistics.median(xs)
        bench_report.add(SUITE, name, tokens_per_s=BATCH / med, median_s=med, rounds=len(xs),
                         samples=[BATCH / x for x in xs])


def test_engine_7b_shaped_scattered(benchmark, bench_report):
    device = bench_report.device
    dtype = _dtype(device)
    h = StepHarness(seven_b_shaped(), device, dtype, adapters=32, ctx=[CTX] * BATCH)
    fns = {"7b/none": h.step_fn(None), "7b/1": h.step_fn(1), "7b/8": h.step_fn(8), "7b/32": h.step_fn(32)}
    for kernel in ("segments", "dense", "gather"):
        fns[f"7b/32-{kernel}"] = h.step_fn(32, kernel)
    fns["7b/none-paged"], fns["7b/32-paged"] = h.step_fn(None, attention="paged"), h.step_fn(32, attention="paged")
    fns["7b/32-paged-compiled"] = h.step_fn(32, attention="paged", compiled=True)
    chosen = [p.mode for p in h.lora.prepare([h.slots[i] for i in range(BATCH)], prefill=False).pools]
    benchmark.group = "7B-shaped decode step (one round = every variant once)"
    samples = interleaved(benchmark, fns, rounds=8 if device == "cpu" else 30, device=h.device)
    _record(bench_report, samples)
    bench_report.note(SUITE, "7b model", f"2 layers, hidden 4096, MLP 11008, 32 heads (Llama-2-7B layer dims), "
                                         f"{str(dtype).replace('torch.', '')}, batch {BATCH} decode rows of {CTX}-token contexts")
    bench_report.note(SUITE, "7b adapters", f"rank {RANK} on all 7 projections, 32 adapters on scattered slots of a "
                                            f"{SLOTS}-slot pool ({h.slots[:6]}...); auto picked {chosen} for 32 distinct")


def test_engine_long_row(benchmark, bench_report):
    """One 1,088-token row among 31 of 64 tokens vs all 64: buckets vs one group padded to the longest."""
    import handler.model.runner as model_mod

    device = bench_report.device
    dtype = _dtype(device)
    short = StepHarness(_small_model(), device, dtype, adapters=0, ctx=[CTX] * BATCH)
    mixed = StepHarness(_small_model(), device, dtype, adapters=0, ctx=[CTX + 1024] + [CTX] * (BATCH - 1))
    step_short, step_mixed = short.step_fn(None), mixed.step_fn(None)
    real = model_mod._decode_buckets

    def padded():  # the old layout: every decode row in one group padded to the longest
        model_mod._decode_buckets = lambda ctx, bs: [list(range(len(ctx)))]
        try:
            step_mixed()
        finally:
            model_mod._decode_buckets = real

    fns = {"long/all-short": step_short, "long/one-long": step_mixed, "long/one-long-padded": padded,
           "long/all-short-paged": short.step_fn(None, attention="paged"),
           "long/one-long-paged": mixed.step_fn(None, attention="paged"),
           "long/all-short-compiled": short.step_fn(None, compiled=True),
           "long/all-short-paged-compiled": short.step_fn(None, attention="paged", compiled=True)}
    benchmark.group = "one long row among short ones (small dev model)"
    samples = interleaved(benchmark, fns, rounds=30 if device == "cpu" else 100, device=short.device)
    _record(bench_report, samples)
    bench_report.note(SUITE, "long row", f"small dev model, {str(dtype).replace('torch.', '')}, 32 decode rows of {CTX} "
                                         f"tokens, or one of {CTX + 1024} among 31 of {CTX}, no adapters")
