"""Engine throughput on the small dev model (hidden 384, 6 layers, MLP 1024), batch 32.

* decode: 32 running requests, tokens/s of the decode steps only, with no adapters, 1 adapter for
  all rows, 8 and 32 distinct adapters (rank 16 on all seven projections, random weights) on
  scattered slots of a 64-slot pool, as LRU leaves them (the engine mounts 32 fillers in between
  and unmounts them);
* admission: 64 requests asking max_tokens 1,024 that stop after 100 tokens (the client cancels),
  KV blocks on demand vs prompt + max_tokens reserved at admission (the old policy): peak
  concurrent sequences and tokens/s;
* end to end, the same workload as a user would run it with transformers + PEFT: 32 prompts of 64
  tokens, 64 new tokens each (greedy, EOS ignored), prefill included; ours vs `generate` on a
  PeftModel holding the same 32 adapters with a mixed batch (`adapter_names`), and both without
  adapters.

Variants of one test run interleaved (one round = every variant once, shuffled order), so ratios
are per round and machine drift hits every variant alike.

    make bench PYTEST_ARGS='-k engine'
    # or: .venv/bin/python -m pytest benchmarks/bench_engine.py --benchmark-only --benchmark-enable
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

import pytest
import torch

from handler.engine.engine import Engine, SamplingParams

SUITE = "engine"
BATCH, PROMPT, NEW, RANK, ALPHA = 32, 64, 64, 16, 32
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LORAFARM_CACHE_DIR", REPO / ".cache" / "lorafarm"))


def _small_model() -> Path:
    from lorafarm.dev.model import write_dev_model

    path = CACHE / "devmodel-small-s0"
    stamp = path / "lorafarm_devmodel.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == {"size": "small", "seed": 0}):
        write_dev_model(path, size="small", seed=0, force=True)
    return path


def _adapters(model_dir: Path, count: int) -> list[dict[str, torch.Tensor]]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    shapes = {"q_proj": (cfg.num_attention_heads * hd, h), "k_proj": (cfg.num_key_value_heads * hd, h),
              "v_proj": (cfg.num_key_value_heads * hd, h), "o_proj": (h, cfg.num_attention_heads * hd),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        w = {}
        for layer in range(n):
            for m in MODULES:
                d, k = shapes[m]
                p = f"base_model.model.model.layers.{layer}.{'self_attn' if m in MODULES[:4] else 'mlp'}.{m}"
                w[p + ".lora_A.weight"] = torch.randn(RANK, k, generator=g) / k**0.5
                w[p + ".lora_B.weight"] = torch.randn(d, RANK, generator=g) * 0.02
        out.append(w)
    return out


class Setup:
    def __init__(self, device: str):
        self.device = device
        self.model_dir = _small_model()
        self.adapters = _adapters(self.model_dir, BATCH)
        g = torch.Generator().manual_seed(1)
        self.prompts = torch.randint(3, 450, (BATCH, PROMPT), generator=g)
        self.attention = "auto"
        self.engine = self.new_engine()
        # what "auto" picked (the engine's probe), fixed for every later engine of the run
        self.attention, self.probe = self.engine.attention, self.engine.measure_attention()
        self._peft = None
        self._rid = 0

    def new_engine(self, attention: str | None = None) -> Engine:
        engine = Engine(self.model_dir, device=self.device, dtype=torch.float32, kv_cache_bytes=64 << 20,
                        max_batch=BATCH, rank_pools={RANK: 2 * BATCH}, max_prefill_tokens=BATCH * PROMPT,
                        attention=attention or self.attention)
        order = [f"a{j}" for j in range(BATCH)] + [f"filler{j}" for j in range(BATCH)]
        random.Random(0).shuffle(order)  # scattered slots, as LRU leaves them
        for name in order:
            w = self.adapters[int(name[1:])] if name.startswith("a") else self.adapters[0]
            engine.mount_adapter(name, w, rank=RANK, alpha=ALPHA, target_modules=MODULES)
        for j in range(BATCH):
            engine.unmount_adapter(f"filler{j}")
        return engine

    def adapter_of_row(self, distinct: int | None) -> list[str | None]:
        return [None if distinct is None else f"a{i % distinct}" for i in range(BATCH)]

    def submit(self, distinct: int | None, engine: Engine | None = None) -> None:
        params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        for row, ad in enumerate(self.adapter_of_row(distinct)):
            self._rid += 1
            (engine or self.engine).add_request(f"r{self._rid}", self.prompts[row].tolist(), params, ad, lambda ev: None)

    def drain(self) -> None:
        while self.engine.step():
            pass

    def peft(self):
        if self._peft is None:
            from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device).eval()
            cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES, lora_dropout=0.0)
            model = get_peft_model(base, cfg, adapter_name="a0")
            for j in range(1, BATCH):
                model.add_adapter(f"a{j}", cfg)
            for j, w in enumerate(self.adapters):
                set_peft_model_state_dict(model, {k: v.to(self.device) for k, v in w.items()}, adapter_name=f"a{j}")
            self._peft = model.eval()
        return self._peft

    def peft_generate(self, distinct: int | None) -> torch.Tensor:
        model = self.peft()
        ids = self.prompts.to(self.device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                  do_sample=False, pad_token_id=self.engine.tokenizer.pad_token_id)
        with torch.inference_mode():
            if distinct is None:
                with model.disable_adapter():
                    return model.generate(**kw)
            return model.generate(**kw, adapter_names=[f"a{i % distinct}" for i in range(BATCH)])


@pytest.fixture(scope="module")
def setup(bench_report):
    return Setup(bench_report.device)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _interleave(benchmark, variants: dict, rounds: int, device: str) -> dict[str, list[float]]:
    """variants: name -> (prepare, timed); every round runs each variant once in shuffled order."""
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)

    def one_round(record=True):
        rng.shuffle(names)
        for n in names:
            prepare, timed = variants[n]
            prepare()
            _sync(device)
            t0 = time.perf_counter()
            timed()
            _sync(device)
            if record:
                samples[n].append(time.perf_counter() - t0)

    one_round(record=False)  # warm-up
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    return samples


def _notes(bench_report, setup):
    cfg = setup.engine.config
    bench_report.note(SUITE, "model", f"small dev model (hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
                                      f"MLP {cfg.intermediate_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} kv), fp32")
    bench_report.note(SUITE, "batch", f"{BATCH} requests, prompts of {PROMPT} tokens, {NEW} new tokens each, greedy")
    bench_report.note(SUITE, "adapters", f"rank {RANK} on all 7 projections; row i uses adapter i mod N")
    p = setup.probe
    bench_report.note(SUITE, "decode attention", f"{setup.attention} (the engine's startup probe at {BATCH} rows: "
                                                 f"paged {p.paged_ms:.3f} / {p.short_paged_ms:.3f} ms vs gathered "
                                                 f"{p.gathered_ms:.3f} / {p.short_gathered_ms:.3f} ms on mixed / short "
                                                 f"contexts; {p.reason})")


DECODE_VARIANTS = (("none", None), ("1", 1), ("8", 8), ("32", 32))


def test_engine_decode(benchmark, bench_report, setup):
    """Decode tokens/s for 32 running rows: no adapters vs 1, 8, 32 distinct adapters.

    One engine per variant (same model, same 32 adapters mounted), each with its own 32 running
    requests; a round is one decode step of every engine in shuffled order, so the per-step ratios
    are paired and immune to drift slower than a step. Prefill steps are not timed."""
    engines = {label: setup.engine if label == "32" else setup.new_engine() for label, _ in DECODE_VARIANTS}
    samples: dict[str, list[float]] = {f"decode/{label}": [] for label, _ in DECODE_VARIANTS}
    names = [label for label, _ in DECODE_VARIANTS]
    rng = random.Random(0)

    def refill():
        if any(not e.has_work() for e in engines.values()):
            for label, distinct in DECODE_VARIANTS:
                e = engines[label]
                while e.step():  # finish whatever is left (untimed), then 32 new requests
                    pass
                setup.submit(distinct, e)
                e.step()  # the prefill step: every row gets its first token (untimed)

    def one_round():
        rng.shuffle(names)
        for label in names:
            _sync(setup.device)
            t0 = time.perf_counter()
            engines[label].step()
            _sync(setup.device)
            samples[f"decode/{label}"].append(time.perf_counter() - t0)

    refill()
    for _ in range(3):  # warm-up rounds
        one_round()
    for xs in samples.values():
        xs.clear()
    benchmark.group = "engine decode (one round = one decode step of every variant)"
    benchmark.pedantic(one_round, setup=refill, rounds=(NEW - 2) * 3, iterations=1, warmup_rounds=0)
    for e in engines.values():
        while e.step():
            pass
    for name, xs in samples.items():
        med = statistics.median(xs)
        bench_report.add(SUITE, name, tokens_per_s=BATCH / med, median_s=med, rounds=len(xs),
                         samples=[BATCH / x for x in xs])
    _notes(bench_report, setup)
    bench_report.note(SUITE, "decode timing", "tokens/s = 32 rows / median decode-step time; one engine per variant, "
                                              "steps interleaved")


def test_engine_vs_transformers_peft(benchmark, bench_report, setup):
    """End-to-end tokens/s, prefill included: ours vs transformers generate (+ PEFT mixed batch)."""
    # same greedy tokens on a row as PEFT (sanity: we benchmark the same computation)
    setup.drain()
    first_rid = setup._rid + 1
    setup.submit(32)
    reqs = [setup.engine._requests[f"r{first_rid + i}"] for i in range(BATCH)]  # noqa: SLF001 - a peek
    setup.drain()
    ref = setup.peft_generate(32)[:, PROMPT:]
    for row in (0, 5, 31):
        assert reqs[row].out[:8] == ref[row, :8].tolist()

    variants = {
        "e2e/ours-none": (lambda: setup.submit(None), setup.drain),
        "e2e/ours-32": (lambda: setup.submit(32), setup.drain),
        "e2e/hf-none": (lambda: None, lambda: setup.peft_generate(None)),
        "e2e/peft-32": (lambda: None, lambda: setup.peft_generate(32)),
    }
    benchmark.group = "engine end-to-end (one round = every variant once)"
    samples = _interleave(benchmark, variants, rounds=5 if setup.device == "cuda" else 4, device=setup.device)
    tokens = BATCH * NEW
    for name, xs in samples.items():
        med = statistics.median(xs)
        bench_report.add(SUITE, name, tokens_per_s=tokens / med, median_s=med, rounds=len(xs),
                         samples=[tokens / x for x in xs])
    _notes(bench_report, setup)


ADMIT_REQUESTS, ADMIT_MAX_TOKENS, ADMIT_STOP = 64, 1024, 100


def test_engine_admission(benchmark, bench_report, setup):
    """Concurrent sequences and tokens/s when clients ask max_tokens 1,024 and stop after ~100."""
    results = {}

    def run(reserve: str):
        cfg = setup.engine.config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
        engine = Engine(setup.model_dir, device=setup.device, dtype=torch.float32,
                        kv_cache_bytes=7 * (PROMPT + ADMIT_MAX_TOKENS) * per_token, max_batch=BATCH,
                        rank_pools={RANK: 1}, kv_reserve=reserve, attention=setup.attention)
        done = []

        def on_event(ev):
            if ev.finished:
                done.append(ev.request_id)
            elif ev.completion_tokens >= ADMIT_STOP:
                engine.cancel(ev.request_id)  # the client has what it wanted

        params = SamplingParams(max_tokens=ADMIT_MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for i in range(ADMIT_REQUESTS):
            engine.add_request(f"q{i}", setup.prompts[i % BATCH].tolist(), params, None, on_event)
        peak, t0 = 0, time.perf_counter()
        while engine.step():
            peak = max(peak, engine.stats().running)
        elapsed = time.perf_counter() - t0
        assert len(done) == ADMIT_REQUESTS
        results[reserve] = dict(peak_running=peak, tokens_per_s=ADMIT_REQUESTS * ADMIT_STOP / elapsed,
                                median_s=elapsed, rounds=1, preemptions=engine.stats().preemptions,
                                kv_blocks=engine.kv.num_blocks)

    benchmark.group = "admission (one round = both policies once)"
    benchmark.pedantic(lambda: [run("demand"), run("max_tokens")], rounds=1, iterations=1, warmup_rounds=0)
    for reserve, r in results.items():
        bench_report.add(SUITE, f"admit/{reserve}", **r)
    bench_report.note(SUITE, "admission", f"{ADMIT_REQUESTS} requests, prompts of {PROMPT}, max_tokens "
                                          f"{ADMIT_MAX_TOKENS}, cancelled after {ADMIT_STOP} tokens; KV cache of "
                                          f"7 x (prompt + max_tokens) tokens; no adapters")


INV_ROUNDS = int(os.environ.get("LORAFARM_BENCH_INVARIANT_ROUNDS", "24"))


def test_engine_batch_invariant_cost(benchmark, bench_report):
    """The cost of `Engine(batch_invariant=True)` (replica --batch-invariant) against the default mode
    in the same run: decode tokens/s of 32 rows on 32 distinct adapters on scattered slots (one
    decode step of each engine per round, shuffled), and a whole batch end to end (prefill of 32
    prompts of 64 tokens, then 16 tokens each; one batch of each engine per round). Both engines
    decode with the gathered attention (what "auto" takes for this model on the CPU)."""
    model_dir = _small_model()
    adapters = _adapters(model_dir, BATCH)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 450, (BATCH, PROMPT), generator=g)
    device = bench_report.device

    def new_engine(invariant: bool) -> Engine:
        e = Engine(model_dir, device=device, dtype=torch.float32, kv_cache_bytes=64 << 20, max_batch=BATCH,
                   rank_pools={RANK: 2 * BATCH}, max_prefill_tokens=BATCH * PROMPT, attention="gather",
                   batch_invariant=invariant)
        order = [f"a{j}" for j in range(BATCH)] + [f"filler{j}" for j in range(BATCH)]
        random.Random(0).shuffle(order)
        for name in order:
            w = adapters[int(name[1:])] if name.startswith("a") else adapters[0]
            e.mount_adapter(name, w, rank=RANK, alpha=ALPHA, target_modules=MODULES)
        for j in range(BATCH):
            e.unmount_adapter(f"filler{j}")
        return e

    engines = {"default": new_engine(False), "invariant": new_engine(True)}
    rid = [0]

    def submit(e: Engine, new: int) -> None:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for row in range(BATCH):
            rid[0] += 1
            e.add_request(f"i{rid[0]}", prompts[row].tolist(), params, f"a{row}", lambda ev: None)

    samples: dict[str, list[float]] = {f"invariant/{k}-{w}": [] for k in engines for w in ("decode", "e2e")}
    names = list(engines)
    rng = random.Random(0)

    def refill():
        for e in engines.values():
            if not e.has_work():
                submit(e, NEW)
                e.step()  # prefill (untimed)

    def one_round():
        rng.shuffle(names)
        for k in names:
            _sync(device)
            t0 = time.perf_counter()
            engines[k].step()
            _sync(device)
            samples[f"invariant/{k}-decode"].append(time.perf_counter() - t0)

    refill()
    for _ in range(2):
        one_round()
    for xs in samples.values():
        xs.clear()
    benchmark.group = "batch-invariant mode vs default (one round = one decode step of each)"
    benchmark.pedantic(one_round, setup=refill, rounds=INV_ROUNDS, iterations=1, warmup_rounds=0)
    for e in engines.values():
        while e.step():
            pass
    e2e_new = 16
    for _ in range(max(2, INV_ROUNDS // 8)):
        rng.shuffle(names)
        for k in names:
            e = engines[k]
            submit(e, e2e_new)
            _sync(device)
            t0 = time.perf_counter()
            while e.step():
                pass
            _sync(device)
            samples[f"invariant/{k}-e2e"].append(time.perf_counter() - t0)
    for name, xs in samples.items():
        med = statistics.median(xs)
        per = BATCH if name.endswith("decode") else BATCH * e2e_new
        bench_report.add(SUITE, name, tokens_per_s=per / med, median_s=med, rounds=len(xs), samples=[per / x for x in xs])
    bench_report.note(SUITE, "batch-invariant mode", f"32 rows on 32 distinct rank-{RANK} adapters on scattered slots, "
                                                     f"gathered attention; decode: one step of each engine per round "
                                                     f"({INV_ROUNDS} rounds); e2e: 32 prompts of {PROMPT} + {e2e_new} "
                                                     f"tokens each")
