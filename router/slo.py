"""Per-tenant time-to-first-token SLO: p95 over a sliding window, a gauge, and a log line when a
tenant's p95 passes the target (on the transition, then at most once a minute while it stays)."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("lorafarm.router.slo")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class TenantSlo:
    tenant_id: str
    samples: int
    p95: float | None
    breached: bool


class SloTracker:
    def __init__(
        self,
        target: float = 1.0,
        window: float = 300.0,
        min_samples: int = 10,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[str, float | None, bool], None] | None = None,
        relog_every: float = 60.0,
    ):
        self.target = target
        self.window = window
        self.min_samples = min_samples
        self.clock = clock
        self.on_update = on_update  # (tenant, p95, breached): feeds the Prometheus gauges
        self.relog_every = relog_every
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._breached: dict[str, bool] = {}
        self._last_log: dict[str, float] = {}

    def record(self, tenant_id: str, ttft: float) -> None:
        self._samples.setdefault(tenant_id, deque()).append((self.clock(), ttft))

    def _prune(self, now: float) -> None:
        horizon = now - self.window
        for tenant in list(self._samples):
            dq = self._samples[tenant]
            while dq and dq[0][0] < horizon:
                dq.popleft()

    def p95(self, tenant_id: str) -> float | None:
        self._prune(self.clock())
        dq = self._samples.get(tenant_id)
        if not dq:
            return None
        return percentile([v for _, v in dq], 95)

    def evaluate(self) -> dict[str, TenantSlo]:
        """Recompute every tenant's p95; update gauges; log breaches. Called every second."""
        now = self.clock()
        self._prune(now)
        out: dict[str, TenantSlo] = {}
        for tenant, dq in list(self._samples.items()):
            if not dq:
                # nothing in the window: no longer breached, forget the tenant
                del self._samples[tenant]
                if self._breached.pop(tenant, False):
                    log.info("tenant %s TTFT SLO recovered (no requests in the last %.0f s)", tenant, self.window)
                if self.on_update:
                    self.on_update(tenant, None, False)
                continue
            values = [v for _, v in dq]
            p95 = percentile(values, 95)
            breached = len(values) >= self.min_samples and p95 > self.target
            was = self._breached.get(tenant, False)
            if breached and (not was or now - self._last_log.get(tenant, -math.inf) >= self.relog_every):
                log.warning(
                    "tenant %s TTFT p95 %.3f s above the %.3f s target (%d requests in %.0f s)",
                    tenant, p95, self.target, len(values), self.window,
                )  # fmt: skip
                self._last_log[tenant] = now
            elif was and not breached:
                log.info("tenant %s TTFT p95 %.3f s back under the %.3f s target", tenant, p95, self.target)
            self._breached[tenant] = breached
            if self.on_update:
                self.on_update(tenant, p95, breached)
            out[tenant] = TenantSlo(tenant, len(values), p95, breached)
        return out
