"""Router overhead: time to first token (TTFT) through the router minus straight to the replica.

Three processes on 127.0.0.1: the stand-in replica and registry (test doubles from
tests/router/doubles.py: the replica streams `--chunks` SSE chunks, the first after
`--first-token-ms`), the real router (`lorafarm router` as a subprocess), and this client. Requests
go out at a steady rate, alternating direct / via router so both see the same machine noise; TTFT is
the time to the first chunk carrying generated text, end-to-end the time to `[DONE]`. Prints p50/p95/p99 of each and
of the difference, and writes them as JSON with --out.

    .venv/bin/python benchmarks/bench_router_overhead.py --rate 20 --requests 400

A standalone script (no pytest-benchmark fixture), so `make bench` collects nothing from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[k]


async def _serve_doubles(args) -> None:
    """Child process: the stand-in registry and replica; prints their URLs and keys, then serves."""
    sys.path.insert(0, str(REPO))
    from tests.router.doubles import FakeRegistry, FakeReplica, start_server

    replica = FakeReplica(
        "r0", base="dev-a", chunks=args.chunks, first_token_delay=args.first_token_ms / 1000,
        chunk_delay=args.chunk_ms / 1000, gpu_slots=8,
    )  # fmt: skip
    registry = FakeRegistry()
    rep_served = await start_server(replica.app())
    reg_served = await start_server(registry.app())
    registry.add_replica("r0", rep_served.url, "dev-a")
    key = registry.add_tenant("bench")
    aid = registry.add_adapter("bench", "a", "dev-a", alias="bench/a:prod")
    replica.warm(aid)
    print(json.dumps({"registry": reg_served.url, "replica": rep_served.url, "api_key": key, "adapter_id": aid}),
          flush=True)  # fmt: skip
    await asyncio.Event().wait()


def _has_token(payload: str) -> bool:
    """A chunk with generated text (the empty role chunk a replica sends first does not count)."""
    payload = payload.strip()
    if payload == "[DONE]":
        return False
    try:
        choices = json.loads(payload).get("choices") or []
    except (ValueError, AttributeError):
        return False
    return any((c.get("delta") or {}).get("content") or c.get("text") for c in choices if isinstance(c, dict))


async def _one(http, url: str, headers: dict, body: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    ttft = None
    async with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data:") and _has_token(line[5:]):
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


async def _run(args) -> dict:
    import httpx

    from tests.router.doubles import ADMIN_TOKEN

    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAFARM_ADMIN_TOKEN": ADMIN_TOKEN}
    doubles = subprocess.Popen(
        [sys.executable, __file__, "--serve-doubles", "--chunks", str(args.chunks),
         "--first-token-ms", str(args.first_token_ms), "--chunk-ms", str(args.chunk_ms)],
        stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    router = None
    try:
        info = json.loads(doubles.stdout.readline())
        port = _free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "lorafarm", "router", "--port", str(port), "--registry", info["registry"],
             "--strategy", args.strategy, "--log-level", "warning"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        router_url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as http:
            for _ in range(300):
                try:
                    if (await http.get(router_url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("router did not become healthy")
            msg = [{"role": "user", "content": "hello there"}]
            direct = (info["replica"] + "/v1/chat/completions", {"Authorization": f"Bearer {ADMIN_TOKEN}"},
                      {"model": info["adapter_id"], "messages": msg, "stream": True, "max_tokens": 16})  # fmt: skip
            routed = (router_url + "/v1/chat/completions", {"Authorization": f"Bearer {info['api_key']}"},
                      {"model": "bench/a:prod", "messages": msg, "stream": True, "max_tokens": 16})  # fmt: skip
            for target in (direct, routed) * 10:  # warm-up: connections, caches
                await _one(http, *target)
            results: dict[str, list[tuple[float, float]]] = {"direct": [], "router": []}
            cpu_before = _cpu_seconds(router.pid)
            interval = 1.0 / args.rate
            start = time.perf_counter()
            tasks = []
            for i in range(args.requests):
                name, target = ("direct", direct) if i % 2 == 0 else ("router", routed)
                delay = start + i * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)

                async def go(name=name, target=target):
                    results[name].append(await _one(http, *target))

                tasks.append(asyncio.create_task(go()))
            await asyncio.gather(*tasks)
            wall = time.perf_counter() - start
            cpu_after = _cpu_seconds(router.pid)
    finally:
        for p in (router, doubles):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
    report: dict = {
        "rate_per_s": args.rate, "requests": args.requests, "wall_s": round(wall, 2),
        "replica": {"first_token_ms": args.first_token_ms, "chunks": args.chunks, "chunk_ms": args.chunk_ms},
    }  # fmt: skip
    if cpu_before is not None and cpu_after is not None:
        # everything the router process did in the window (its 1 s polls included), per routed request
        report["router_cpu_ms_per_request"] = round((cpu_after - cpu_before) * 1000 / len(results["router"]), 2)
    for metric, idx in (("ttft", 0), ("e2e", 1)):
        for name in ("direct", "router"):
            vals = [r[idx] * 1000 for r in results[name]]
            report[f"{metric}_{name}_ms"] = {
                "p50": round(_pct(vals, 50), 2), "p95": round(_pct(vals, 95), 2),
                "p99": round(_pct(vals, 99), 2), "mean": round(statistics.fmean(vals), 2),
            }  # fmt: skip
        report[f"{metric}_overhead_ms"] = {
            q: round(report[f"{metric}_router_ms"][q] - report[f"{metric}_direct_ms"][q], 2)
            for q in ("p50", "p95", "p99", "mean")
        }
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=20.0, help="requests per second, both paths together")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--first-token-ms", type=float, default=20.0)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-ms", type=float, default=5.0)
    p.add_argument("--strategy", default="least_tokens")
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--serve-doubles", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_doubles:
        asyncio.run(_serve_doubles(args))
        return 0
    sys.path.insert(0, str(REPO))
    report = asyncio.run(_run(args))
    print(json.dumps(report, indent=2))
    o = report["ttft_overhead_ms"]
    print(f"router TTFT overhead at {args.rate:g} req/s: p50 {o['p50']:+.2f} ms, p99 {o['p99']:+.2f} ms; "
          f"router CPU {report.get('router_cpu_ms_per_request', '?')} ms/request")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
