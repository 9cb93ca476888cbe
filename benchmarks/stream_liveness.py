"""Streams under load through a real farm (issue 26): N concurrent streamed chats x T tokens, R
rounds, on the base model and on an adapter, through `lorafarm up --replicas 1`; counts failed
requests (an exception or an error event) and reports TTFT p50/p95 and the longest request.

    python -m benchmarks.stream_liveness --state-dir var/liveness --streams 32 --tokens 128 --rounds 2 \
        --replica-flags '--stream-keepalive-s 0' --out var/liveness-before.json
    python -m benchmarks.stream_liveness --state-dir var/liveness --streams 32 --tokens 128 --rounds 2 \
        --out var/liveness-after.json

`--dev` serves the toy dev model instead of the real SmolLM2-135M-Instruct. The farm is stopped
(SIGINT) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _one(client, model: str, tokens: int, i: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    err = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}],
            max_tokens=tokens, temperature=0.7, seed=i, stream=True)
        async for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or "") and ttft is None:
                ttft = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - counted
        err = f"{type(e).__name__}: {e}"[:300]
    return {"model": model, "ok": err is None, "error": err, "ttft": ttft, "total": time.perf_counter() - t0}


async def _run(router_url: str, api_key: str, models: list[str], streams: int, tokens: int, rounds: int) -> list:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=router_url + "/v1", api_key=api_key, max_retries=0, timeout=900)
    out = []
    for r in range(rounds):
        for model in models:
            res = await asyncio.gather(*(_one(client, model, tokens, r * 1000 + i) for i in range(streams)))
            out += res
            ok = sum(x["ok"] for x in res)
            print(f"round {r + 1} {model}: {ok}/{len(res)} ok", file=sys.stderr, flush=True)
    await client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-dir", default="var/liveness")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=18800)
    p.add_argument("--replica-flags", default="")
    p.add_argument("--router-flags", default="")
    p.add_argument("--dev", action="store_true")
    p.add_argument("--base", default=None, help="serve this checkpoint (lorafarm up --base): the base model only")
    p.add_argument("--seed-model", default=None,
                   help="with --dev: copy this dev model folder into the state dir (no rebuild)")
    p.add_argument("--seed-canaries", default=None,
                   help="with --dev: copy c0000..c0003 from this canary folder (no training)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    state = Path(args.state_dir)
    cmd = [sys.executable, "-m", "lorafarm", "up", "--replicas", "1", "--state-dir", str(state),
           "--port", str(args.port), "--registry-port", str(args.port + 1), "--replica-port", str(args.port + 10),
           "--replica-flags", args.replica_flags, "--router-flags", args.router_flags] + (["--dev"] if args.dev else []) \
        + (["--base", args.base] if args.base else [])
    state.mkdir(parents=True, exist_ok=True)
    if args.dev and args.seed_model and args.seed_canaries:
        import shutil

        from lorafarm.farm import DEMO_ADAPTERS, Farm

        f = Farm(state, replicas=1, progress=False, demo_adapters=DEMO_ADAPTERS)
        if not f.model_dir.exists():
            shutil.copytree(args.seed_model, f.model_dir)
        for i in range(DEMO_ADAPTERS):
            if not (f.adapters_dir / f"c{i:04d}").exists():
                shutil.copytree(Path(args.seed_canaries) / f"c{i:04d}", f.adapters_dir / f"c{i:04d}")
    log = open(state / "up.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if "Ctrl-C stops the farm" in line:
                break
        else:
            raise SystemExit(f"the farm did not start; see {state / 'up.log'}")
        farm = json.loads((state / "farm.json").read_text())
        tenant = farm["tenants"][0]
        alias = sorted(tenant["aliases"])[0] if tenant["aliases"] else None
        base = sorted(farm["base_models"])[0] if isinstance(farm.get("base_models"), (list, dict)) else None
        models = [m for m in (base, alias) if m]
        t0 = time.perf_counter()
        results = asyncio.run(_run(farm["router_url"], tenant["api_key"], models, args.streams, args.tokens,
                                   args.rounds))
        wall = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    summary = {
        "command": " ".join(sys.argv), "requests": len(results), "failed": sum(not r["ok"] for r in results),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p95_s": _pct(ttfts, 0.95),
        "longest_request_s": max((r["total"] for r in results), default=None),
        "longest_ttft_s": max(ttfts, default=None), "wall_s": wall, "models": models,
        "load_avg": os.getloadavg(),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
