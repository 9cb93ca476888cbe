"""Replay a workload against an OpenAI-compatible endpoint and measure it the way vLLM's
`benchmarks/serve.py` does: TTFT, TPOT (time per output token), E2E latency, split by the tier the
replica reported (`x-adapter-tier`) and by replica (`x-replica-id`, when the router sends it)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx

from loadtests.workload import WorkItem


@dataclass
class Result:
    model: str
    ok: bool
    status: int
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    tier: str = ""
    adapter_id: str = ""
    replica: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


@dataclass
class Summary:
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0

    def percentiles(self, values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        v = sorted(values)

        def pct(p: float) -> float:
            return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]

        return {"mean": statistics.fmean(v), "p50": pct(50), "p95": pct(95), "p99": pct(99)}

    def by(self, key) -> dict[str, list[Result]]:
        groups: dict[str, list[Result]] = defaultdict(list)
        for r in self.results:
            groups[key(r)].append(r)
        return dict(groups)

    def table(self) -> list[dict]:
        rows = []
        ok = [r for r in self.results if r.ok]
        groups = {"all": ok, **{f"tier={k}": v for k, v in self.by(lambda r: r.tier).items() if k}}
        for name, rs in groups.items():
            rs = [r for r in rs if r.ok]
            ttft = self.percentiles([r.ttft for r in rs if r.ttft is not None])
            tpot = self.percentiles([r.tpot for r in rs if r.tpot is not None])
            rows.append(
                {
                    "group": name,
                    "requests": len(rs),
                    "ttft_p50_ms": 1000 * ttft.get("p50", float("nan")),
                    "ttft_p95_ms": 1000 * ttft.get("p95", float("nan")),
                    "tpot_p50_ms": 1000 * tpot.get("p50", float("nan")),
                    "tpot_p95_ms": 1000 * tpot.get("p95", float("nan")),
                }
            )
        return rows

    @property
    def errors(self) -> int:
        return sum(not r.ok for r in self.results)

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.results if r.ok) / self.wall if self.wall else 0.0


async def _one(client: httpx.AsyncClient, url: str, key: str, item: WorkItem) -> Result:
    body = {
        "model": item.model,
        "messages": [{"role": "user", "content": item.prompt}],
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST", f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            res = Result(
                item.model,
                resp.status_code == 200,
                resp.status_code,
                tier=resp.headers.get("x-adapter-tier", ""),
                adapter_id=resp.headers.get("x-adapter-id", ""),
                replica=resp.headers.get("x-replica-id", ""),
            )
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")[:200]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.ok, res.error = False, str(event["error"].get("message", ""))[:200]
                    continue
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    if res.ttft is None:
                        res.ttft = time.perf_counter() - start
                    res.tokens += 1
            res.e2e = time.perf_counter() - start
            return res
    except httpx.HTTPError as e:
        return Result(item.model, False, 0, error=f"{type(e).__name__}: {e}")


async def replay(url: str, api_key: str, items: list[WorkItem], progress=None, timeout: float = 120.0) -> Summary:
    """Send every item at its arrival time (open loop: arrivals don't wait for answers)."""
    summary = Summary()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def fire(item: WorkItem) -> None:
            delay = item.at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            summary.results.append(await _one(client, url, api_key, item))
            if progress is not None:
                progress.update(1)

        await asyncio.gather(*(fire(i) for i in items))
        summary.wall = time.perf_counter() - start
    return summary
