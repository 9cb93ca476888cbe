"""Start one standalone replica on a model folder; print the time until /health answers, the time of a
first 16-token chat and the replica's RSS after it (docs/real-models.md, "Memory sizing").

    .venv/bin/python benchmarks/replica_footprint.py MODEL_DIR [--port 18931] [--inductor-cache DIR] [REPLICA FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--inductor-cache", default=None)
    a, flags = p.parse_known_args()  # anything else goes to `lorafarm replica`
    flags = [f for f in flags if f != "--"]
    env = dict(os.environ)
    if a.inductor_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = a.inductor_cache
    log = tempfile.NamedTemporaryFile("w", prefix="replica-footprint-", suffix=".log", delete=False)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "lorafarm", "replica", "--base", a.model, "--port", str(a.port),
                             "--disk-dir", tempfile.mkdtemp(prefix="replica-footprint-disk-"), *flags],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{a.port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                print(f"replica exited; log in {log.name}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        start = time.monotonic() - t0
        t1 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{a.port}/v1/chat/completions", timeout=600, json={
            "model": os.path.basename(os.path.normpath(a.model)), "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        first = time.monotonic() - t1
        status = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status") if ":" in line)
        rss = int(status["VmRSS"].split()[0]) * 1024
        answer = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text[:200]
        print(json.dumps({"flags": flags, "start_s": round(start, 1), "first_answer_s": round(first, 2),
                          "rss_mb": rss // 2**20, "answer": answer}))
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
