"""Prometheus metrics of the router, in the vLLM naming style with the `lorafarm_router_` prefix.
Each app gets its own CollectorRegistry, so several routers can live in one process (tests)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lorafarm.client.summary import VersionCounts
from router.routing import ReplicaSnapshot

log = logging.getLogger("lorafarm.router.metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


ADAPTER_BUCKETS = 64  # per-adapter series: adapter ids hashed into this many fixed labels


def adapter_bucket(adapter_id: str, buckets: int = ADAPTER_BUCKETS) -> str:
    """The fixed label (`00`..`63`) an adapter's counters land in: sha256(id) mod buckets. The
    series count stays `buckets` whatever the number of adapters; exact per-adapter numbers are
    the registry's `adapter_stats` (pushed by the router every stats window)."""
    return f"{int.from_bytes(hashlib.sha256(adapter_id.encode()).digest()[:8], 'big') % buckets:02d}"


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        labels = ["tier", "route_class"]
        self.ttft = Histogram(
            "lorafarm_router_time_to_first_token_seconds",
            "Request arrival at the router to the first streamed byte to the client, streamed requests",
            labels, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "lorafarm_router_e2e_request_latency_seconds",
            "Request arrival at the router to the last byte",
            labels, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "lorafarm_router_requests", "Requests answered, by endpoint, HTTP status and routing class",
            ["endpoint", "status", "route_class"], registry=r,
        )  # fmt: skip
        self.failovers = Counter(
            "lorafarm_router_failovers", "Replica attempts that failed before the first byte and moved on",
            ["reason"], registry=r,
        )  # fmt: skip
        self.stream_errors = Counter(
            "lorafarm_router_stream_errors", "Streams that broke after the first byte (client got an error event)",
            registry=r,
        )  # fmt: skip
        self.poison_requests = Counter(
            "lorafarm_router_poison_requests", "Requests refused as poison (in flight at replica deaths): "
            "outcome stopped (refused after its own second death) | refused (refused before routing)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.replica_deaths = Counter(
            "lorafarm_router_replica_deaths", "Replicas that died with a request in flight (connection broken "
            "and /health gone), by phase: before_first_byte | mid_stream", ["phase"], registry=r,
        )  # fmt: skip
        self.deadline_exceeded = Counter(
            "lorafarm_router_deadline_exceeded", "Requests ended by their deadline (x-request-timeout or the "
            "non-stream default): 504, or an error event mid-stream", registry=r,
        )  # fmt: skip
        self.rate_limited = Counter(
            "lorafarm_router_rate_limited", "Requests refused with 429 by the per-tenant buckets", registry=r
        )
        self.in_flight = Gauge("lorafarm_router_num_requests_running", "Requests being proxied now", registry=r)
        self.tenant_ttft_p95 = Gauge(
            "lorafarm_router_tenant_ttft_p95_seconds", "Per-tenant p95 TTFT over the SLO window", ["tenant"],
            registry=r,
        )  # fmt: skip
        self.tenant_slo_breached = Gauge(
            "lorafarm_router_tenant_ttft_slo_breached", "1 while the tenant's p95 TTFT is above the target",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.replica_healthy = Gauge(
            "lorafarm_router_replica_healthy", "1 while the replica is routable", ["replica"], registry=r
        )
        self.replica_state_fresh = Gauge(
            "lorafarm_router_replica_state_fresh", "1 when the last state poll succeeded (0: possibly warm)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.replica_tokens = Gauge(
            "lorafarm_router_replica_tokens_in_flight", "Tokens in flight per replica as routing sees them",
            ["replica"], registry=r,
        )  # fmt: skip
        self.routing_version = Gauge(
            "lorafarm_router_routing_table_version", "Version of the registry routing table in use", registry=r
        )
        self.registry_errors = Counter(
            "lorafarm_router_registry_errors", "Failed registry calls", ["call"], registry=r
        )
        self.registry_calls = Counter(
            "lorafarm_router_registry_calls", "Registry calls made (auth: key checks; routing: table fetches)",
            ["kind"], registry=r,
        )  # fmt: skip

        self.critical_workers = Gauge(
            "lorafarm_router_critical_model_workers",
            "Healthy workers holding each latency-critical model (the two-workers rule wants >= 2)",
            ["model"], registry=r,
        )  # fmt: skip
        self.critical_degraded = Gauge(
            "lorafarm_router_critical_model_degraded", "1 while a latency-critical model has fewer than two "
            "healthy workers", ["model"], registry=r,
        )  # fmt: skip
        # chargeback: per tenant (one series per tenant) and per adapter bucket (bounded)
        self.tenant_requests = Counter(
            "lorafarm_router_tenant_requests", "Requests answered per tenant, by status class (2xx, 4xx, 5xx)",
            ["tenant", "status_class"], registry=r,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "lorafarm_router_tenant_tokens", "Tokens per tenant: kind prompt | completion",
            ["tenant", "kind"], registry=r,
        )  # fmt: skip
        self.adapter_requests = Counter(
            "lorafarm_router_adapter_requests", "Requests per adapter bucket (sha256(adapter_id) mod 64)",
            ["adapter_bucket"], registry=r,
        )  # fmt: skip
        self.adapter_tokens = Counter(
            "lorafarm_router_adapter_tokens", "Tokens per adapter bucket (sha256(adapter_id) mod 64)",
            ["adapter_bucket"], registry=r,
        )  # fmt: skip
        self.price_per_replica_hour = Gauge(
            "lorafarm_router_price_per_replica_hour", "Configured price of one replica-hour (cost per token derives from it)",
            registry=r,
        )  # fmt: skip
        self.registry_reachable = Gauge(
            "lorafarm_router_registry_reachable", "1 when the last routing-table poll reached the registry", registry=r
        )
        self.versions = VersionMetrics(r)

    def observe_critical(self, holders: dict[str, int]) -> None:
        for (model,) in [k for k in list(self.critical_workers._metrics) if k[0] not in holders]:
            self.critical_workers.remove(model)
            self.critical_degraded.remove(model)
        for model, n in holders.items():
            self.critical_workers.labels(model).set(n)
            self.critical_degraded.labels(model).set(1 if n < 2 else 0)

    def record_usage(self, tenant: str, status: int, prompt_tokens: int, completion_tokens: int,
                     adapter_id: str | None) -> None:
        """Count one answered request for chargeback."""
        self.tenant_requests.labels(tenant, f"{status // 100}xx").inc()
        if prompt_tokens:
            self.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.tenant_tokens.labels(tenant, "completion").inc(completion_tokens)
        if adapter_id:
            bucket = adapter_bucket(adapter_id)
            self.adapter_requests.labels(bucket).inc()
            self.adapter_tokens.labels(bucket).inc(prompt_tokens + completion_tokens)

    def observe_replica(self, s: ReplicaSnapshot) -> None:
        self.replica_healthy.labels(s.replica_id).set(1 if s.healthy else 0)
        self.replica_state_fresh.labels(s.replica_id).set(1 if s.state_fresh else 0)
        self.replica_tokens.labels(s.replica_id).set(s.tokens_in_flight)

    def forget_replica(self, replica_id: str) -> None:
        for g in (self.replica_healthy, self.replica_state_fresh, self.replica_tokens):
            try:
                g.remove(replica_id)
            except KeyError:
                pass

    def set_tenant_slo(self, tenant: str, p95: float | None, breached: bool) -> None:
        if p95 is None:
            for g in (self.tenant_ttft_p95, self.tenant_slo_breached):
                try:
                    g.remove(tenant)
                except KeyError:
                    pass
            return
        self.tenant_ttft_p95.labels(tenant).set(p95)
        self.tenant_slo_breached.labels(tenant).set(1 if breached else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# -- per-version metrics of split aliases (issue 38) ---------------------------------------------

# what a request to one version of a split alias ended as (the `outcome` label)
OK, ERROR, CLIENT_ERROR, CANCELLED = "ok", "error", "client_error", "cancelled"
MAX_VERSION_SERIES = 4096  # (alias, version) pairs tracked per router process


class VersionMetrics:
    """Requests, errors by kind, TTFT, tokens, finish reasons and client cancels per (alias, version)
    for aliases whose traffic is split (a rollout or `aliases split`), with `alias` and `version`
    (the adapter id) labels. Only split aliases are tracked, so the series count follows the splits in
    use, not the number of adapters. Besides the Prometheus series, the same counts are kept twice as
    `VersionCounts`: since this router started (`summary()`, GET /internal/versions) and since the
    last push to the registry (`push()`, every stats window), which is what a rollout judges."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        labels = ["alias", "version"]
        self.requests = Counter(
            "lorafarm_router_version_requests", "Requests to one version of a split alias, by outcome "
            "(ok | error | client_error | cancelled)", [*labels, "outcome"], registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "lorafarm_router_version_errors", "Server-side failures of a version, by kind (upstream_5xx, "
            "unavailable, replica_died, stream_error, timeout, upstream_429)", [*labels, "kind"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "lorafarm_router_version_time_to_first_token_seconds", "Time to first token of streamed requests, "
            "per version of a split alias", labels, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "lorafarm_router_version_tokens", "Tokens per version of a split alias: kind prompt | completion",
            [*labels, "kind"], registry=r,
        )  # fmt: skip
        self.finish_reasons = Counter(
            "lorafarm_router_version_finish_reasons", "Choices finished per version, by finish_reason",
            [*labels, "reason"], registry=r,
        )  # fmt: skip
        self.cancels = Counter(
            "lorafarm_router_version_client_cancels", "Requests whose client went away before the answer was "
            "complete, per version", labels, registry=r,
        )  # fmt: skip
        self.started_at = datetime.now(UTC)
        self.total: dict[tuple[str, str], VersionCounts] = {}
        self.window: dict[tuple[str, str], VersionCounts] = {}
        self._window_started = time.monotonic()
        self._push_failing = False  # warned once; quiet until a push succeeds

    def _counts(self, key: tuple[str, str]) -> list[VersionCounts] | None:
        if key not in self.total:
            if len(self.total) >= MAX_VERSION_SERIES:
                return None
            self.total[key] = VersionCounts()
        return [self.total[key], self.window.setdefault(key, VersionCounts())]

    def record(self, alias: str, version: str, outcome: str, *, kind: str | None = None, ttft: float | None = None,
               prompt_tokens: int = 0, completion_tokens: int = 0, finish_reasons: dict[str, int] | None = None) -> None:
        """One request to `version` of the split `alias` ended with `outcome` (OK, ERROR with its
        `kind`, CLIENT_ERROR, CANCELLED)."""
        key = (alias, version)
        counts = self._counts(key)
        if counts is None:
            return
        self.requests.labels(alias, version, outcome).inc()
        for c in counts:
            c.requests += 1
        if outcome == ERROR:
            kind = kind or "error"
            self.errors.labels(alias, version, kind).inc()
            for c in counts:
                c.add_error(kind)
        elif outcome == CLIENT_ERROR:
            for c in counts:
                c.client_errors += 1
        elif outcome == CANCELLED:
            self.cancels.labels(alias, version).inc()
            for c in counts:
                c.cancels += 1
        if ttft is not None:
            self.ttft.labels(alias, version).observe(ttft)
            for c in counts:
                c.add_ttft(ttft)
        if prompt_tokens:
            self.tokens.labels(alias, version, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.tokens.labels(alias, version, "completion").inc(completion_tokens)
        for reason, n in (finish_reasons or {}).items():
            self.finish_reasons.labels(alias, version, reason).inc(n)
        for c in counts:
            c.prompt_tokens += max(0, prompt_tokens)
            c.completion_tokens += max(0, completion_tokens)
            if finish_reasons:
                c.add_finish(finish_reasons)

    def summary(self, alias: str | None = None) -> dict:
        """Counts since this router started: {router_started_at, versions: [{alias, version, ...summary}]}."""
        rows = [{"alias": a, "version": v, **c.summary()} for (a, v), c in sorted(self.total.items())
                if alias is None or a == alias]
        return {"since": self.started_at.isoformat(), "versions": rows}

    async def push(self, send: Callable[[float, list[dict]], Awaitable[None]]) -> int:
        """Send the counts since the last push (`send(window_s, rows)`); kept for the next push when
        it fails. Returns the rows sent."""
        window, self.window = self.window, {}
        now = time.monotonic()
        window_s = max(0.001, now - self._window_started)
        if not window:
            self._window_started = now
            return 0
        rows = [{"alias": a, "adapter_id": v, **c.to_wire()} for (a, v), c in sorted(window.items())]
        try:
            await send(round(window_s, 3), rows)
        except Exception as e:
            (log.debug if self._push_failing else log.warning)(
                "version stats push to the registry failed (%s); keeping %d rows for the next window", e, len(rows))
            self._push_failing = True
            for key, c in window.items():
                self.window.setdefault(key, VersionCounts()).merge(c)
            raise
        if self._push_failing:
            log.info("version stats pushed to the registry again")
            self._push_failing = False
        self._window_started = now
        return len(rows)
