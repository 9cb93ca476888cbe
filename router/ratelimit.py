"""Per-tenant token buckets: one on requests per second, one on tokens per second.

A request costs 1 request and (prompt tokens + max_tokens) tokens. Both buckets must hold enough
or nothing is taken and the caller gets a 429 with the wait until both would. Capacity is
rate x burst_seconds (at least one request's worth), so a tenant may burst up to that.
A request larger than the whole token bucket is admitted when the bucket is full (it would never
fit otherwise) and leaves the bucket in debt. After the response the router settles the estimate
against the usage the replica reported (`settle`).

Several routers: `RedisRateLimiter` keeps the buckets in Redis (one hash per tenant and kind, updated
by one Lua script per check, atomically, on Redis's clock), so N routers enforce one limit together.
Without `--redis-url` every router enforces the whole limit on its own (N routers admit up to N x the
limit). If Redis is unreachable a check falls back to this router's local buckets (fail open to the
per-router limit) and logs it."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("lorafarm.router.ratelimit")


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


def _result(allowed: bool, wait: float, req: _Bucket | None, tok: _Bucket | None) -> LimitResult:
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


def _capacity(rate: float, burst_seconds: float, min_capacity: float = 1.0) -> float:
    return max(rate * burst_seconds, min_capacity)


class RateLimiter:
    """Thread-safe; `now` is injectable for tests."""

    def __init__(self, burst_seconds: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.burst_seconds = burst_seconds
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()

    def _bucket(self, tenant: str, kind: str, rate: float, now: float, min_capacity: float) -> _Bucket:
        capacity = _capacity(rate, self.burst_seconds, min_capacity)
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
            return _result(allowed, wait, req, tok)

    def settle(self, tenant: str, estimated_tokens: int, actual_tokens: int) -> None:
        """Correct the token bucket once the real usage is known (refund or charge the difference)."""
        with self._lock:
            b = self._buckets.get((tenant, "tokens"))
            if b is not None and actual_tokens >= 0:
                b.refill(self.clock())
                b.level = min(b.capacity, b.level + (estimated_tokens - actual_tokens))


# One check, atomic: refill both buckets on Redis's clock, take 1 request and `cost` tokens from
# both or from neither. KEYS: requests hash, tokens hash. ARGV: rate and capacity of each (rate 0 =
# no such bucket), cost, ttl ms. Returns {allowed, wait_s, req_level, tok_level} as strings.
_CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local cost = tonumber(ARGV[5])
local levels, waits = {}, 0
for i = 1, 2 do
  local rate, cap = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  if rate > 0 then
    local v = redis.call('HMGET', KEYS[i], 'level', 'stamp')
    local level, stamp = tonumber(v[1]), tonumber(v[2])
    if level == nil then level, stamp = cap, now end
    if now > stamp then level = math.min(cap, level + (now - stamp) * rate) end
    level = math.min(level, cap)
    local want = 1
    if i == 2 then want = cost end
    local need = math.min(want, cap) - level
    if need > 0 then waits = math.max(waits, need / rate) end
    levels[i] = level
  end
end
local allowed = waits <= 0
for i = 1, 2 do
  if levels[i] ~= nil then
    local level = levels[i]
    if allowed then
      if i == 1 then level = level - 1 else level = level - cost end
    end
    levels[i] = level
    redis.call('HSET', KEYS[i], 'level', tostring(level), 'stamp', tostring(now))
    redis.call('PEXPIRE', KEYS[i], ARGV[6])
  end
end
return {allowed and '1' or '0', tostring(waits), tostring(levels[1] or 0), tostring(levels[2] or 0)}
"""

# settle: refill, then add `delta` tokens (a refund, or a charge when negative), capped.
_SETTLE = """
local v = redis.call('HMGET', KEYS[1], 'level', 'stamp')
local level, stamp = tonumber(v[1]), tonumber(v[2])
if level == nil then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
if now > stamp then level = math.min(cap, level + (now - stamp) * rate) end
level = math.min(cap, level + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'level', tostring(level), 'stamp', tostring(now))
return 1
"""


class RedisRateLimiter:
    """The same buckets as `RateLimiter`, kept in Redis so several routers share them. `check` and
    `settle` have RateLimiter's signatures (sync: one short round trip, `timeout_s` at most, then the
    local fallback)."""

    def __init__(self, url: str, burst_seconds: float = 1.0, *, prefix: str = "lorafarm:rl:",
                 timeout_s: float = 0.05, client=None):
        import redis

        self.burst_seconds = burst_seconds
        self.prefix = prefix
        self.redis = client or redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._check = self.redis.register_script(_CHECK)
        self._settle = self.redis.register_script(_SETTLE)
        self.local = RateLimiter(burst_seconds=burst_seconds)  # fallback while Redis is unreachable
        self._rates: dict[str, float] = {}  # tenant -> tokens/s of the last check (for settle)
        self.fallbacks = 0

    def _keys(self, tenant: str) -> list[str]:
        return [f"{self.prefix}{tenant}:requests", f"{self.prefix}{tenant}:tokens"]

    def check(self, tenant: str, *, requests_per_s: float | None, tokens_per_s: float | None,
              tokens: int) -> LimitResult:
        rq = requests_per_s if requests_per_s and requests_per_s > 0 else 0.0
        tk = tokens_per_s if tokens_per_s and tokens_per_s > 0 else 0.0
        if not rq and not tk:
            return LimitResult(True, 0.0, {})
        rq_cap, tk_cap = _capacity(rq, self.burst_seconds), _capacity(tk, self.burst_seconds)
        ttl_ms = int(1000 * (60 + max(rq_cap / rq if rq else 0, tk_cap / tk if tk else 0)))
        try:
            allowed, wait, rq_level, tk_level = self._check(
                keys=self._keys(tenant), args=[rq, rq_cap, tk, tk_cap, int(tokens), ttl_ms])
        except Exception as e:  # redis.RedisError, socket timeouts: the local buckets, per router
            self.fallbacks += 1
            log.warning("rate limits: Redis unavailable (%s); this router's own buckets apply", e)
            return self.local.check(tenant, requests_per_s=requests_per_s, tokens_per_s=tokens_per_s, tokens=tokens)
        self._rates[tenant] = tk
        ok = allowed in (b"1", "1")
        req = _Bucket(rq, rq_cap, float(rq_level), 0.0) if rq else None
        tok = _Bucket(tk, tk_cap, float(tk_level), 0.0) if tk else None
        return _result(ok, float(wait), req, tok)

    def settle(self, tenant: str, estimated_tokens: int, actual_tokens: int) -> None:
        tk = self._rates.get(tenant)
        if not tk or actual_tokens < 0:
            return
        try:
            self._settle(keys=self._keys(tenant)[1:], args=[tk, _capacity(tk, self.burst_seconds),
                                                            int(estimated_tokens) - int(actual_tokens)])
        except Exception as e:
            log.warning("rate limits: settle in Redis failed (%s)", e)
        self.local.settle(tenant, estimated_tokens, actual_tokens)


def make_limiter(redis_url: str | None, burst_seconds: float = 1.0) -> RateLimiter | RedisRateLimiter:
    """Redis-backed when a URL is given (several routers share the limits), else per router."""
    if redis_url:
        return RedisRateLimiter(redis_url, burst_seconds)
    return RateLimiter(burst_seconds=burst_seconds)
