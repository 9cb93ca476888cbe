"""Figures of the mixed farm (issue 15), one run:

1. embeddings throughput at batch 32: requests of 32 inputs to a real embedding worker process
   (`lorafarm replica --task embed`), inputs/s, against sentence-transformers' own `encode` on the
   same folder with batch_size=32 in this process (and the bare in-process encoder, no HTTP);
2. the router's added latency for a foreign worker: the same non-streamed chat request sent N times
   straight to a stand-in OpenAI-compatible server and N times through the router (registry +
   router from `lorafarm.farm.Farm`, the stand-in registered with `lorafarm workers add`); p50/p95 of
   each and of the difference.

    flock /tmp/measure.lock python -m benchmarks.mixed_farm_figures --out var/mixed_farm_figures.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _wait(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up")


def embeddings(tmp: Path, size: str, rounds: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    from handler.embed.model import Encoder
    from lorafarm.dev.embedding import write_dev_embedding_model
    from lorafarm.farm import _free_port

    folder = write_dev_embedding_model(tmp / f"embed-{size}", size=size)
    texts = [f"support ticket {i}: my order has not arrived and I would like a refund please " * (1 + i % 3)
             for i in range(32)]
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lorafarm", "replica", "--task", "embed", "--id", "e0",
                             "--base", str(folder), "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(f"http://127.0.0.1:{port}/health")
        name = folder.name
        with httpx.Client(timeout=120) as c:
            for _ in range(3):  # warm-up
                c.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": name, "input": texts})
            t0 = time.perf_counter()
            for _ in range(rounds):
                r = c.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": name, "input": texts})
                r.raise_for_status()
            worker_s = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    st = SentenceTransformer(str(folder), device="cpu")
    st.encode(texts, batch_size=32)
    t0 = time.perf_counter()
    for _ in range(rounds):
        st.encode(texts, batch_size=32)
    st_s = time.perf_counter() - t0
    enc = Encoder(folder, device="cpu")
    ids = enc.tokenize(texts)
    enc.embed_ids(ids)
    t0 = time.perf_counter()
    for _ in range(rounds):
        enc.embed_ids(ids)
    enc_s = time.perf_counter() - t0
    n = rounds * len(texts)
    return {"size": size, "batch": 32, "rounds": rounds, "torch_threads": torch.get_num_threads(),
            "worker_http_inputs_per_s": n / worker_s, "sentence_transformers_inputs_per_s": n / st_s,
            "encoder_in_process_inputs_per_s": n / enc_s, "worker_vs_st": st_s / worker_s}


def router_overhead(tmp: Path, n: int) -> dict:
    from lorafarm.farm import Farm, FarmPorts, _free_port
    from lorafarm.registry_client import RegistryClient

    repo = Path(__file__).resolve().parent.parent
    cache = Path(os.environ.get("LORAFARM_CACHE_DIR", repo / ".cache" / "lorafarm"))
    farm = Farm(tmp / "farm", replicas=0, ports=FarmPorts.free(1), progress=False, demo_adapters=1)
    shutil.copytree(cache / "devmodel-tiny-s0", farm.model_dir)
    shutil.copytree(cache / "canaries-tiny-s0" / "c0000", farm.adapters_dir / "c0000")
    port = _free_port()
    standin = subprocess.Popen([sys.executable, "-m", "tests.e2e.standin", "fw", str(port), "fw-model"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=repo)
    try:
        info = farm.up()
        _wait(f"http://127.0.0.1:{port}/v1/models")
        import asyncio

        async def add():
            async with RegistryClient(info["registry_url"], info["admin_token"]) as reg:
                await reg.put_worker("fw", f"http://127.0.0.1:{port}", "openai")

        asyncio.run(add())
        key = info["tenants"][0]["api_key"]
        h = {"Authorization": f"Bearer {key}"}
        body = {"model": "fw-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ids = {m["id"] for m in httpx.get(info["router_url"] + "/v1/models", headers=h).json()["data"]}
            if "fw-model" in ids:
                break
            time.sleep(0.2)
        direct, routed = [], []
        with httpx.Client(timeout=30) as c:
            for _ in range(20):  # warm-up, both paths
                c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                c.post(info["router_url"] + "/v1/chat/completions", json=body, headers=h)
            for _ in range(n):  # interleaved so drift in machine load hits both alike
                t0 = time.perf_counter()
                c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body).raise_for_status()
                direct.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = c.post(info["router_url"] + "/v1/chat/completions", json=body, headers=h)
                r.raise_for_status()
                assert r.headers["x-replica-id"] == "worker:fw"
                routed.append(time.perf_counter() - t0)
    finally:
        farm.stop()
        standin.terminate()
        standin.wait(timeout=20)
    ms = lambda x: round(x * 1000, 2)  # noqa: E731
    diffs = [r - d for r, d in zip(routed, direct, strict=True)]
    return {"requests": n, "direct_p50_ms": ms(_pct(direct, 0.5)), "direct_p95_ms": ms(_pct(direct, 0.95)),
            "router_p50_ms": ms(_pct(routed, 0.5)), "router_p95_ms": ms(_pct(routed, 0.95)),
            "added_p50_ms": ms(_pct(routed, 0.5) - _pct(direct, 0.5)),
            "added_p95_ms": ms(_pct(routed, 0.95) - _pct(direct, 0.95)),
            "paired_diff_median_ms": ms(statistics.median(diffs))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30, help="batches of 32 per embeddings measurement")
    ap.add_argument("--requests", type=int, default=300, help="chat requests per path for the router overhead")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--out", default="var/mixed_farm_figures.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorafarm-fig-") as tmp:
        out = {"embeddings": [embeddings(Path(tmp), s, args.rounds) for s in args.sizes.split(",")],
               "router_foreign_worker": router_overhead(Path(tmp), args.requests),
               "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
