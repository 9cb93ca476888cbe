"""Per-tenant token buckets: one on requests per second, one on tokens per second.

A request costs 1 request and (prompt tokens + max_tokens) tokens. Both buckets must hold enough
or nothing is taken and the caller gets a 429 with the wait until both would. Capacity is
rate x burst_seconds (at least one request's worth), so a tenant may burst up to that.
A request larger than the whole token bucket is admitted when the bucket is full (it would never
fit otherwise) and leaves the bucket in debt. After the response the router settles the estimate
against the usage the replica reported (`settle`)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    rate: float
    capacity: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, cost: float) -> float:
        """Seconds until `cost` fits (0 when it does now)."""
        need = min(cost, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def reset_after(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.level) / self.rate)


@dataclass(frozen=True)
class LimitResult:
    allowed: bool
    retry_after: float  # seconds; 0 when allowed
    headers: dict[str, str]


def _fmt_reset(seconds: float) -> str:
    """OpenAI style: '1s', '6m0s', '120ms'."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(int(math.ceil(seconds)), 60)
    return f"{m}m{s}s"


class RateLimiter:
    """Thread-safe; `now` is injectable for tests."""

    def __init__(self, burst_seconds: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.burst_seconds = burst_seconds
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()

    def _bucket(self, tenant: str, kind: str, rate: float, now: float, min_capacity: float) -> _Bucket:
        capacity = max(rate * self.burst_seconds, min_capacity)
        b = self._buckets.get((tenant, kind))
        if b is None:
            b = self._buckets[(tenant, kind)] = _Bucket(rate, capacity, capacity, now)
        elif b.rate != rate or b.capacity != capacity:  # the tenant's limits changed
            b.refill(now)
            b.rate, b.capacity = rate, capacity
            b.level = min(b.level, capacity)
        else:
            b.refill(now)
        return b

    def check(
        self,
        tenant: str,
        *,
        requests_per_s: float | None,
        tokens_per_s: float | None,
        tokens: int,
    ) -> LimitResult:
        """Take 1 request and `tokens` tokens from `tenant`'s buckets, or nothing and say how long
        to wait. A rate of None (or <= 0) is unlimited."""
        now = self.clock()
        with self._lock:
            req = (
                self._bucket(tenant, "requests", requests_per_s, now, 1.0)
                if requests_per_s and requests_per_s > 0
                else None
            )
            tok = (
                self._bucket(tenant, "tokens", tokens_per_s, now, 1.0)
                if tokens_per_s and tokens_per_s > 0
                else None
            )
            wait = max(req.wait_for(1) if req else 0.0, tok.wait_for(tokens) if tok else 0.0)
            allowed = wait <= 0
            if allowed:
                if req:
                    req.level -= 1
                if tok:
                    tok.level -= tokens
            headers = {}
            for kind, b in (("requests", req), ("tokens", tok)):
                if b is None:
                    continue
                headers[f"x-ratelimit-limit-{kind}"] = str(int(b.capacity))
                headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(b.level)))
                headers[f"x-ratelimit-reset-{kind}"] = _fmt_reset(b.reset_after())
            if not allowed:
                headers["retry-after"] = str(max(1, math.ceil(wait)))
                headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
            return LimitResult(allowed, 0.0 if allowed else wait, headers)

    def settle(self, tenant: str, estimated_tokens: int, actual_tokens: int) -> None:
        """Correct the token bucket once the real usage is known (refund or charge the difference)."""
        with self._lock:
            b = self._buckets.get((tenant, "tokens"))
            if b is not None and actual_tokens >= 0:
                b.refill(self.clock())
                b.level = min(b.capacity, b.level + (estimated_tokens - actual_tokens))
