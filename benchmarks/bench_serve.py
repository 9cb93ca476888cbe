"""Ours vs `transformers serve --continuous-batching` on the base model, streamed over HTTP.

Both servers run as real processes on 127.0.0.1 with the small dev model in float32 on the CPU
(one intra-op thread each, OMP_NUM_THREADS=1): ours is `lorafarm replica` in standalone mode, the
baseline `transformers serve <model> --continuous-batching`. The official `openai` client sends
streamed chat completions at concurrency 32 (max_tokens 32, temperature 0, usage in the final
chunk); rounds alternate ours / theirs. tokens/s = completion tokens (from usage) / wall time of a
round; TTFT = time to the first chunk carrying a token (content or finish), p95 over all requests.

    make bench PYTEST_ARGS='-k serve'
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import pytest

from benchmarks.bench_engine import SUITE, _small_model
from lorafarm.dev.executables import console_script

CONCURRENCY, REQUESTS, MAX_TOKENS, ROUNDS = 32, 64, 32, 2
KV_TOKENS, CB_BLOCK = 8192, 32  # the same KV capacity for both (transformers sizes its cache to RAM otherwise)
MAX_RSS_BYTES = 6 << 30  # a shared machine: stop if a server grows past this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if _rss(proc.pid) > MAX_RSS_BYTES:
            raise RuntimeError(f"server {proc.args[:3]} uses more than {MAX_RSS_BYTES >> 30} GiB")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


async def _round(base_url: str, model: str, prompts: list[str]) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0)
    sem = asyncio.Semaphore(CONCURRENCY)
    ttft, tokens = [], []

    async def one(p: str):
        async with sem:
            t0 = time.perf_counter()
            first, used = None, 0
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0.0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                    first = time.perf_counter() - t0
                if chunk.usage:
                    used = chunk.usage.completion_tokens
            ttft.append(first if first is not None else time.perf_counter() - t0)
            tokens.append(used)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return {"wall": wall, "tokens": sum(tokens), "ttft": ttft}


def _kv_bytes_per_token(model) -> int:
    from handler.model.kvcache import KVCache
    from handler.model.runner import ModelConfig, load_hf_config

    import torch

    c = ModelConfig.from_hf(load_hf_config(model))
    return KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)


def test_serve_vs_transformers_serve(benchmark, bench_report, tmp_path):
    transformers_cli = console_script("transformers")
    if transformers_cli is None:
        pytest.skip("the transformers CLI is not installed")
    from lorafarm.dev.adapters import random_prompts

    model = _small_model()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    ours_port, hf_port = _free_port(), _free_port()
    procs = {
        "ours": subprocess.Popen(
            [sys.executable, "-m", "lorafarm", "replica", "--base", str(model), "--host", "127.0.0.1",
             "--port", str(ours_port), "--model-name", "base", "--device", "cpu", "--dtype", "float32",
             "--max-batch", str(CONCURRENCY), "--kv-cache-bytes", str(KV_TOKENS * _kv_bytes_per_token(model)),
             "--disk-dir", str(tmp_path / "replica"), "--log-level", "warning",
             "--attention", os.environ.get("LORAFARM_BENCH_ATTENTION", "auto")],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "ours.log", "w")),
        "hf": subprocess.Popen(
            [transformers_cli, "serve", str(model), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
             "--cb-block-size", str(CB_BLOCK), "--cb-num-blocks", str(KV_TOKENS // CB_BLOCK),
             "--host", "127.0.0.1", "--port", str(hf_port), "--log-level", "warning"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "hf.log", "w")),
    }
    targets = {"ours": (f"http://127.0.0.1:{ours_port}/v1", "base", f"http://127.0.0.1:{ours_port}/ready"),
               "hf": (f"http://127.0.0.1:{hf_port}/v1", str(model), f"http://127.0.0.1:{hf_port}/health")}
    try:
        for name, (_, _, ready) in targets.items():
            _wait_ready(ready, procs[name])
        prompts = random_prompts(seed=3, count=REQUESTS)
        for name, (url, mname, _) in targets.items():  # warm-up: first requests, allocation, caches
            asyncio.run(_round(url, mname, prompts[:CONCURRENCY]))
        runs = {"ours": [], "hf": []}

        def rounds():
            order = ["ours", "hf", "hf", "ours"] * (ROUNDS // 2)
            for name in order:
                url, mname, _ = targets[name]
                runs[name].append(asyncio.run(_round(url, mname, prompts)))
                for n, p in procs.items():
                    assert _rss(p.pid) < MAX_RSS_BYTES, f"{n} server grew past {MAX_RSS_BYTES >> 30} GiB"

        benchmark.group = "serve (one round = ours and transformers serve, alternating)"
        benchmark.pedantic(rounds, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    for name, rs in runs.items():
        tok = sum(r["tokens"] for r in rs)
        wall = sum(r["wall"] for r in rs)
        ttft = sorted(x for r in rs for x in r["ttft"])
        bench_report.add(SUITE, f"serve/{name}", tokens_per_s=tok / wall, median_s=statistics.median(r["wall"] for r in rs),
                         rounds=len(rs), ttft_p50_s=ttft[len(ttft) // 2], ttft_p95_s=ttft[int(0.95 * (len(ttft) - 1))],
                         completion_tokens=tok)
    bench_report.note(SUITE, "serve", f"small dev model, fp32, CPU; {REQUESTS} streamed chat completions per round at "
                                      f"concurrency {CONCURRENCY}, max_tokens {MAX_TOKENS}; ours = lorafarm replica, "
                                      f"theirs = transformers serve --continuous-batching; both OMP_NUM_THREADS=1 and a KV cache of "
                                      f"{KV_TOKENS} tokens")
