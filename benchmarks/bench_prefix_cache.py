"""The prefix cache (handler.model.prefix_cache): what a cached system prompt saves, with and without it in
the same run (interleaved rounds, shuffled order; figures go to the engine suite).

* TTFT of a request whose 1,000-token system prompt is cached vs not, on an adapter (rank 16, all
  seven projections), with a fresh 24-token question every round (only the system prompt can hit):
  on the small dev model and on the real model (SmolLM2-135M-Instruct, `lorafarm realmodel`; skipped
  where the package registry cannot be reached).
* Throughput of a burst of 64 requests on the small dev model: 80% carry one of 20 system prompts
  (300 tokens; each customer's prompt goes with its own adapter, 8 adapters) and 20% a unique
  300-token prompt, each + a 24-token question, 16 new tokens. Every round starts cold (a fresh
  tenant salt): a system prompt is reused only within the round, after its first request has been
  prefilled; nothing is carried over, so this is the least the cache gives.

    make bench PYTEST_ARGS='-k prefix'
"""

from __future__ import annotations

import os
import random
import statistics
import time

import pytest
import torch

from benchmarks.bench_engine import ALPHA, MODULES, RANK, SUITE, _adapters, _small_model, _sync
from handler.engine.engine import Engine, SamplingParams

ROUNDS = int(os.environ.get("LORAFARM_BENCH_PREFIX_ROUNDS", "8"))
SYSTEM, QUESTION = 1000, 24


def _engine(model_dir, device, cached: bool, adapters: list, max_batch: int = 32) -> Engine:
    e = Engine(model_dir, device=device, dtype=torch.float32, kv_cache_bytes=None, max_batch=max_batch,
               rank_pools={RANK: max(len(adapters), 1)}, prefix_cache=cached, attention="gather")
    for i, w in enumerate(adapters):
        e.mount_adapter(f"a{i}", w, rank=RANK, alpha=ALPHA, target_modules=MODULES)
    return e


def _ttft(e: Engine, rid: str, prompt: list[int], adapter: str, salt: str = "t") -> tuple[float, int]:
    first = []
    e.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), adapter,
                  lambda ev: first.append(ev) if ev.token_id is not None else None, cache_salt=salt)
    _sync(e.device.type)
    t0 = time.perf_counter()
    while not first:
        e.step()
    _sync(e.device.type)
    dt = time.perf_counter() - t0
    while e.step():
        pass
    return dt, first[0].cached_tokens


def _ttft_pair(benchmark, bench_report, model_dir, label: str, device: str):
    adapters = _adapters(model_dir, 1)
    engines = {"cached": _engine(model_dir, device, True, adapters), "uncached": _engine(model_dir, device, False, adapters)}
    n_vocab = engines["cached"].config.vocab_size
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, n_vocab - 1, (SYSTEM,), generator=g).tolist()
    _ttft(engines["cached"], "warm", system + [5] * QUESTION, "a0")  # the system prompt is now cached
    samples: dict[str, list[float]] = {k: [] for k in engines}
    hits: list[int] = []
    names = list(engines)
    rng = random.Random(0)
    rid = [0]

    def one_round():
        question = torch.randint(3, n_vocab - 1, (QUESTION,), generator=g).tolist()
        rng.shuffle(names)
        for k in names:
            rid[0] += 1
            dt, cached = _ttft(engines[k], f"q{rid[0]}", system + question, "a0")
            samples[k].append(dt)
            if k == "cached":
                hits.append(cached)

    one_round()  # warm-up (allocator, first-shape costs), not recorded
    for xs in samples.values():
        xs.clear()
    hits.clear()
    benchmark.group = f"prefix cache: TTFT with a cached 1,000-token system prompt ({label})"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    for k, xs in samples.items():
        bench_report.add(SUITE, f"prefix/ttft-{k}-{label}", ttft_s=statistics.median(xs), median_s=statistics.median(xs),
                         rounds=len(xs), samples=xs)
    ratio = statistics.median(c / u for c, u in zip(samples["cached"], samples["uncached"]))
    cfg = engines["cached"].config
    bench_report.note(SUITE, f"prefix cache TTFT ({label})",
                      f"{cfg.num_layers} layers, hidden {cfg.hidden_size}: system prompt {SYSTEM} tokens + "
                      f"{QUESTION}-token question, rank-{RANK} adapter, {ROUNDS} interleaved rounds; cached tokens per "
                      f"hit {min(hits)}; TTFT median {statistics.median(samples['cached']) * 1e3:.0f} ms cached vs "
                      f"{statistics.median(samples['uncached']) * 1e3:.0f} ms not ({ratio:.3f}x)")
    assert min(hits) >= SYSTEM // 16 * 16 - 16  # the whole system prompt but a partial block


def test_prefix_cache_ttft_dev_model(benchmark, bench_report):
    _ttft_pair(benchmark, bench_report, _small_model(), "dev", bench_report.device)


def test_prefix_cache_ttft_real_model(benchmark, bench_report):
    from tests.real_model import real_model_dir

    _ttft_pair(benchmark, bench_report, real_model_dir(), "real", bench_report.device)


def test_prefix_cache_shared_system_prompts_throughput(benchmark, bench_report):
    model_dir = _small_model()
    device = bench_report.device
    adapters = _adapters(model_dir, 8)
    engines = {"cached": _engine(model_dir, device, True, adapters), "uncached": _engine(model_dir, device, False, adapters)}
    n_vocab = engines["cached"].config.vocab_size
    g = torch.Generator().manual_seed(11)
    systems = [torch.randint(3, n_vocab - 1, (300,), generator=g).tolist() for _ in range(20)]
    rng = random.Random(5)
    n_req, new = 64, 16
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    samples: dict[str, list[float]] = {k: [] for k in engines}
    hit_rate: list[float] = []
    names = list(engines)
    rnd = [0]

    def workload():
        out = []
        for i in range(n_req):
            question = torch.randint(3, n_vocab - 1, (QUESTION,), generator=g).tolist()
            if rng.random() < 0.8:  # a customer's system prompt, sent with that customer's adapter
                k = rng.randrange(len(systems))
                out.append((systems[k] + question, f"a{k % len(adapters)}"))
            else:
                unique = torch.randint(3, n_vocab - 1, (300,), generator=g).tolist()
                out.append((unique + question, f"a{rng.randrange(len(adapters))}"))
        return out

    def one_round():
        rnd[0] += 1
        jobs = workload()
        rng.shuffle(names)
        for k in names:
            e = engines[k]
            before = e.stats()
            for i, (ids, ad) in enumerate(jobs):
                e.add_request(f"r{rnd[0]}-{i}", ids, params, ad, None, cache_salt=f"round{rnd[0]}")
            _sync(device)
            t0 = time.perf_counter()
            while e.step():
                pass
            _sync(device)
            samples[k].append(n_req * new / (time.perf_counter() - t0))
            if k == "cached":
                after = e.stats()
                hit_rate.append((after.prefix_cache_hits - before.prefix_cache_hits)
                                / max(1, after.prefix_cache_queries - before.prefix_cache_queries))

    one_round()
    for xs in samples.values():
        xs.clear()
    hit_rate.clear()
    benchmark.group = "prefix cache: 80% of requests share one of 20 system prompts (tokens/s)"
    benchmark.pedantic(one_round, rounds=max(3, ROUNDS // 2), iterations=1, warmup_rounds=0)
    for k, xs in samples.items():
        bench_report.add(SUITE, f"prefix/mix-{k}", tokens_per_s=statistics.median(xs), rounds=len(xs), samples=xs)
    bench_report.note(SUITE, "prefix cache mix",
                      f"{n_req} requests at once (batch 32), 80% with one of 20 system prompts of 300 tokens (each with its "
                      f"customer's adapter), 20% a "
                      f"unique 300-token prompt, + {QUESTION}-token question, {new} new tokens, 8 rank-{RANK} adapters; "
                      f"cold each round (fresh tenant salt); prompt-token hit rate median "
                      f"{statistics.median(hit_rate):.2f}")
    assert statistics.median(hit_rate) > 0.2
