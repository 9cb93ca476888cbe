"""Per-adapter traffic counted at the gateway and pushed to the registry every window
(`POST /internal/stats`); the registry turns it into owner counts. A failed push keeps the counts
for the next window, so nothing is lost while the registry restarts."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("lorafarm.router.stats")


@dataclass
class AdapterCounts:
    requests: int = 0
    tokens: int = 0
    gpu_hits: int = 0


class StatsAccumulator:
    def __init__(self, max_adapters: int = 200_000):
        self._counts: dict[str, AdapterCounts] = {}
        self.max_adapters = max_adapters

    def record(self, adapter_id: str, tokens: int, gpu_hit: bool) -> None:
        c = self._counts.get(adapter_id)
        if c is None:
            if len(self._counts) >= self.max_adapters:
                return
            c = self._counts[adapter_id] = AdapterCounts()
        c.requests += 1
        c.tokens += max(0, int(tokens))
        c.gpu_hits += 1 if gpu_hit else 0

    def drain(self) -> dict[str, AdapterCounts]:
        counts, self._counts = self._counts, {}
        return counts

    def restore(self, counts: dict[str, AdapterCounts]) -> None:
        for adapter_id, c in counts.items():
            mine = self._counts.setdefault(adapter_id, AdapterCounts())
            mine.requests += c.requests
            mine.tokens += c.tokens
            mine.gpu_hits += c.gpu_hits

    async def push(self, send: Callable[[float, list[dict]], Awaitable[None]], window_s: float) -> int:
        """Send what was counted since the last push; returns the number of adapters sent."""
        counts = self.drain()
        if not counts:
            return 0
        rows = [
            {"adapter_id": a, "requests": c.requests, "tokens": c.tokens, "gpu_hits": c.gpu_hits}
            for a, c in sorted(counts.items())
        ]
        try:
            await send(window_s, rows)
        except Exception as e:
            log.warning("stats push to the registry failed (%s); keeping %d adapters for the next window", e, len(rows))
            self.restore(counts)
            raise
        return len(rows)
