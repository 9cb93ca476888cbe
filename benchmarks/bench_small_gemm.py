"""CPU decode steps four ways, in the same run: the C decode step (handler/model/decode_step.py) with
threads on the LM head only (the default) and on every product (LORAFARM_PARALLEL_PRODUCTS=all), and
the torch forward with the small-M kernel (handler/model/small_gemm.py) or with MKL's F.linear.

Decode steps of 1, 4 and 8 requests on the real model (SmolLM2-135M-Instruct, float32; skipped where
the package registry cannot be reached), each request on its own rank-16 adapter (all seven
projections): the W4 (single stream) and W5 (8 concurrent) shapes of `make bench-peers`. One engine;
every round times each variant once, in a shuffled order, switching only what the step runs.
Figures go to the engine suite (`make bench-docs`).

    make bench PYTEST_ARGS='-k small_gemm'
"""

from __future__ import annotations

import os
import random
import statistics
import time

import pytest
import torch

from benchmarks.bench_engine import ALPHA, MODULES, RANK, SUITE, _adapters
from handler.model import small_gemm
from handler.engine.engine import Engine, SamplingParams

ROUNDS = int(os.environ.get("LORAFARM_BENCH_SMALL_GEMM_ROUNDS", "6"))
ROWS = (1, 4, 8)
PROMPT, NEW = 40, 32


@pytest.fixture(scope="module")
def real_engine():
    from tests.real_model import real_model_dir

    model_dir = real_model_dir()
    adapters = _adapters(model_dir, max(ROWS))
    # no speculative drafts: a step here is one row per request, as on the torch path it is compared with
    e = Engine(model_dir, device="cpu", dtype=torch.float32, kv_cache_bytes=64 << 20, max_batch=32,
               rank_pools={RANK: len(adapters)}, speculate=0)
    for i, w in enumerate(adapters):
        e.mount_adapter(f"a{i}", w, rank=RANK, alpha=ALPHA, target_modules=MODULES)
    return e


def _decode(e: Engine, rows: int, tag: str) -> tuple[float, list[list[int]]]:
    """Seconds per decode step of `rows` requests (after their prefill), and their greedy tokens."""
    outs: list[list[int]] = [[] for _ in range(rows)]
    for i in range(rows):
        e.add_request(f"{tag}-{i}", list(range(100 + i, 100 + i + PROMPT)),
                      SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), f"a{i}",
                      lambda ev, o=outs[i]: o.append(ev.token_id))
    while e._waiting or e._prefilling:  # prefill (and its first token) is not what is compared
        e.step()
    t0, steps = time.perf_counter(), 0
    while e.step():
        steps += 1
    return (time.perf_counter() - t0) / steps, outs


VARIANTS = ("cstep", "cstep-all", "kernel", "mkl")


@pytest.mark.skipif(not small_gemm.available(), reason="small-M kernel not built here (no cc or AVX2)")
def test_small_gemm_decode_steps(benchmark, bench_report, real_engine):
    if bench_report.device != "cpu":
        pytest.skip("a CPU kernel")
    kernel = small_gemm._load()
    cstep, parallel_min = real_engine.decode_step, small_gemm.PARALLEL_MIN
    assert cstep is not None
    variants = [(v, r) for r in ROWS for v in VARIANTS]
    samples: dict[tuple[str, int], list[float]] = {k: [] for k in variants}
    tokens: dict[tuple[str, int], list] = {}
    rng = random.Random(0)
    n = [0]

    def one_round(record: bool = True):
        rng.shuffle(variants)
        for v, r in variants:
            small_gemm._fn = False if v == "mkl" else kernel
            real_engine.decode_step = cstep if v.startswith("cstep") else None
            small_gemm.PARALLEL_MIN = 0 if v == "cstep-all" else parallel_min
            n[0] += 1
            try:
                dt, out = _decode(real_engine, r, f"{v}{n[0]}")
            finally:
                small_gemm._fn, real_engine.decode_step, small_gemm.PARALLEL_MIN = kernel, cstep, parallel_min
            if record:
                samples[(v, r)].append(dt)
                tokens[(v, r)] = out

    one_round(record=False)
    benchmark.group = "C decode step vs torch (small-M kernel, MKL), SmolLM2 decode step (one round = every variant once)"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    notes = []
    for r in ROWS:
        for v in VARIANTS:
            xs = samples[(v, r)]
            bench_report.add(SUITE, f"smallm/{v}-{r}", tokens_per_s=r / statistics.median(xs),
                             median_s=statistics.median(xs), rounds=len(xs), samples=[r / x for x in xs])
        same = all(tokens[(v, r)] == tokens[("mkl", r)] for v in VARIANTS)
        ms = " / ".join(f"{statistics.median(samples[(v, r)]) * 1e3:.1f}" for v in VARIANTS)
        notes.append(f"{r} rows: {ms} ms per step, greedy tokens {'equal' if same else 'DIFFER'}")
    bench_report.note(SUITE, "decode steps (SmolLM2, distinct rank-16 adapters, "
                             f"{torch.get_num_threads()} threads, {ROUNDS} rounds): " + " / ".join(VARIANTS),
                      "; ".join(notes))
