"""Embedding fairness across tenants (issue 21, item 6), one real embedding worker process.

Starts `lorafarm replica --task embed` on the dev encoder (tiny: 128-token context) and measures
the "victim" tenant's 1-input request latency (p50/p95), sequentially:
1. idle: nothing else running;
2. under attack: `--attackers` concurrent loops of another tenant's requests of 2,048 inputs x 120
   tokens each (token-id inputs, so exactly 120 tokens), started before the victim's requests.
Requests carry `x-lorafarm-tenant` as the router sends it. `--repo DIR` runs the worker from another
checkout (e.g. `git archive <commit> | tar -x -C /tmp/before`) for the before figure.

    python -m benchmarks.embed_fairness [--attackers 1] [--requests 40] [--repo DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _victim(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            t = time.perf_counter()
            r = c.post(url + "/v1/embeddings", headers={"x-lorafarm-tenant": "victim"},
                       json={"model": "enc", "input": f"hello number {i}"})
            r.raise_for_status()
            out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attackers", type=int, default=1)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--repo", default=None, help="checkout to run the worker from (default: this one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    repo = Path(args.repo or Path(__file__).resolve().parent.parent).resolve()
    from lorafarm.dev.embedding import write_dev_embedding_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dev_embedding_model(Path(tmp) / "enc", size="tiny")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(repo)}
        log = open(Path(tmp) / "worker.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "lorafarm", "replica", "--task", "embed", "--id", "e0",
                                 "--host", "127.0.0.1", "--port", str(port), "--base", str(folder),
                                 "--model-name", "enc"], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600  # a loaded box starts it slowly
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((Path(tmp) / "worker.log").read_text()[-2000:])
                time.sleep(0.2)
            _victim(url, 5)  # warm-up
            idle = _victim(url, args.requests)
            rng = random.Random(0)
            attack_body = {"model": "enc", "input": [[rng.randrange(10, 450) for _ in range(120)]
                                                     for _ in range(2048)]}
            stop = threading.Event()
            attack_times: list[float] = []

            def attacker():
                with httpx.Client(timeout=600) as c:
                    while not stop.is_set():
                        t = time.perf_counter()
                        r = c.post(url + "/v1/embeddings", headers={"x-lorafarm-tenant": "attacker"},
                                   json=attack_body)
                        assert r.status_code == 200, r.text[:500]
                        attack_times.append(time.perf_counter() - t)

            threads = [threading.Thread(target=attacker, daemon=True) for _ in range(args.attackers)]
            for th in threads:
                th.start()
            time.sleep(1.0)  # the attack's inputs are queued before the victim's first request
            attacked = _victim(url, args.requests)
            stop.set()
            for th in threads:
                th.join()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    res = {
        "repo": str(repo), "attackers": args.attackers, "requests": args.requests,
        "idle_p50_s": round(_pct(idle, 0.5), 4), "idle_p95_s": round(_pct(idle, 0.95), 4),
        "attack_p50_s": round(_pct(attacked, 0.5), 4), "attack_p95_s": round(_pct(attacked, 0.95), 4),
        "attack_request_p50_s": round(_pct(attack_times, 0.5), 3) if attack_times else None,
        "attack_requests_done": len(attack_times),
    }
    res["p95_ratio"] = round(res["attack_p95_s"] / res["idle_p95_s"], 1)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
