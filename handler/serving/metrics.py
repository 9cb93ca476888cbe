"""Replica metrics: Prometheus collectors named like vLLM's under a `lorafarm_` prefix, and the
per-minute rates (loads, evictions) the replica reports to the router.

Each `ReplicaMetrics` owns its own `CollectorRegistry`, so several replicas (or test apps) in one
process never collide on the global registry.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from handler.engine.fairness import QUEUE_BUCKETS

try:  # no `_created` series: they double the exposition size and nothing here reads them
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # pragma: no cover - older prometheus-client
    pass

TIERS = ("gpu", "ram", "disk", "remote")

# Buckets as in vLLM's TTFT / ITL / e2e histograms (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RateWindow:
    """Events in a sliding window (default 60 s): `per_minute()` is the count over the last minute.
    Thread-safe; memory is bounded by the event rate times the window."""

    def __init__(self, window_s: float = 60.0, clock=time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._events: deque[float] = deque()
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int = 1) -> None:
        now = self._clock()
        with self._lock:
            for _ in range(n):
                self._events.append(now)
            self.total += n
            self._trim(now)

    def _trim(self, now: float) -> None:
        cut = now - self.window_s
        while self._events and self._events[0] < cut:
            self._events.popleft()

    def count(self) -> int:
        with self._lock:
            self._trim(self._clock())
            return len(self._events)

    def per_minute(self) -> float:
        return self.count() * 60.0 / self.window_s


class GrammarCollector:
    """The grammar worker pool's counters and the grammar cache's bytes, read at scrape time from
    the handler (handler.grammar.pool): a compile refused for a crash, timeout or memory limit is a
    tenant's hostile or broken schema, a respawn a worker lost to it."""

    def __init__(self, handler):
        self._handler = handler

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h = self._handler
        pool, cache = getattr(h, "grammar_pool", None), getattr(h, "grammar_cache", None)
        compiles = CounterMetricFamily("lorafarm_grammar_compiles", "Grammar compiles sent to the worker pool.")
        failures = CounterMetricFamily("lorafarm_grammar_compile_failures",
                                       "Grammar compiles refused by the pool, by limit.", labels=["limit"])
        respawns = CounterMetricFamily("lorafarm_grammar_worker_respawns", "Grammar workers replaced after a loss.")
        alive = GaugeMetricFamily("lorafarm_grammar_workers_alive", "Grammar worker processes alive.")
        cached = GaugeMetricFamily("lorafarm_grammar_cache_bytes", "Bytes held by the grammar cache.")
        if pool is not None:
            compiles.add_metric([], pool.compiles)
            for limit in ("crash", "timeout", "memory", "invalid"):
                failures.add_metric([limit], pool.failures.get(limit, 0))
            for limit, n in pool.failures.items():
                if limit not in ("crash", "timeout", "memory", "invalid"):
                    failures.add_metric([str(limit)], n)
            respawns.add_metric([], pool.respawns)
            alive.add_metric([], pool.alive)
        if cache is not None:
            cached.add_metric([], cache.bytes)
        yield from (compiles, failures, respawns, alive, cached)


class _EngineStatsCollector:
    """A collector of the handler's engine stats, read at scrape time (nothing before the engine exists)."""

    def __init__(self, handler, model_name: str):
        self._handler = handler
        self._model_name = model_name

    def _stats(self):
        engine = getattr(self._handler, "engine", None)
        return None if engine is None else engine.stats()


class SpeculationCollector(_EngineStatsCollector):
    """The engine's speculative decoding (handler.engine.speculate): draft tokens checked and taken
    (acceptance = accepted / drafted), also under vLLM's names."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        if (st := self._stats()) is None:
            return
        for ours, vllm, help_, value in (
                ("lorafarm_speculative_draft_tokens", "vllm:spec_decode_num_draft_tokens",
                 "N-gram draft tokens checked in decode steps.", st.speculative_drafted),
                ("lorafarm_speculative_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
                 "Draft tokens taken (the model's own greedy tokens).", st.speculative_accepted)):
            m = CounterMetricFamily(ours, help_)
            m.add_metric([], value)
            yield m
            m = CounterMetricFamily(vllm, help_, labels=["model_name"])
            m.add_metric([self._model_name], value)
            yield m


class PrefixCacheCollector(_EngineStatsCollector):
    """The engine's prefix cache (handler.model.prefix_cache): queries and hits in prompt tokens (vLLM's
    convention: hit rate = hits / queries), cached blocks and evictions; also under vLLM's names so
    its dashboards apply."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if (st := self._stats()) is None:
            return
        for name, help_, value in (
                ("lorafarm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st.prefix_cache_queries),
                ("lorafarm_prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).",
                 st.prefix_cache_hits),
                ("lorafarm_prefix_cache_evictions", "Cached KV blocks evicted for space.", st.prefix_cache_evictions),
                ("lorafarm_prefix_cache_deferred", "Admissions put off a step until a prefix block another request "
                 "was computing is cached.", st.prefix_cache_deferred)):
            m = CounterMetricFamily(name, help_)
            m.add_metric([], value)
            yield m
        blocks = GaugeMetricFamily("lorafarm_prefix_cache_blocks", "KV blocks holding a cached prefix block.")
        blocks.add_metric([], st.prefix_cache_blocks)
        yield blocks
        for name, help_, value in (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.",
                                    st.prefix_cache_queries),
                                   ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.",
                                    st.prefix_cache_hits)):
            m = CounterMetricFamily(name, help_, labels=["model_name"])
            m.add_metric([self._model_name], value)
            yield m


TENANT_NONE, TENANT_OTHER = "_none", "_other"  # labels no tenant id can take (ids start with [a-z0-9])


def tenant_label(tenant) -> str:
    return TENANT_NONE if tenant is None else str(tenant)


class TenantCollector(_EngineStatsCollector):
    """Fair scheduling per tenant (handler.engine.fairness), read at scrape time: tokens served,
    admission waits, preemptions, and the fairness state of the active tenants.

    Label cardinality is bounded: `tenant` takes at most NAMED_TENANTS (32) values for the tenants
    served the most recently (the engine's `TenantLedger`: a newcomer displaces a named tenant only
    when served over twice as much recently; "_none" for requests without a tenant) plus "_other"
    (every other tenant, summed; a displaced tenant's totals join it, so every counter stays
    monotonic): at most 33 series per metric (x 2 reasons for preemptions, x 15 buckets for the
    queue-time histogram)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        engine = getattr(self._handler, "engine", None)
        if engine is None or not hasattr(engine, "tenant_stats"):
            return
        st, rep = engine.stats(), engine.tenant_stats()
        usage = [(tenant_label(t), u) for t, u in rep.named.items()] + [(TENANT_OTHER, rep.other)]
        prompt = CounterMetricFamily("lorafarm_tenant_prompt_tokens", "Prompt tokens prefilled per tenant (not prefix "
                                     "cache hits, not recompute).", labels=["tenant"])
        gen = CounterMetricFamily("lorafarm_tenant_generation_tokens", "Tokens generated per tenant.", labels=["tenant"])
        queue = HistogramMetricFamily("lorafarm_tenant_queue_time_seconds", "Engine admission wait per tenant "
                                      "(queued until first admitted to the batch).", labels=["tenant"])
        pre = CounterMetricFamily("lorafarm_tenant_preemptions", "Requests of a tenant preempted, by reason: kv "
                                  "(the KV cache ran out: recomputed), share (another tenant waited below its share "
                                  "of rows: parked with its KV cache).", labels=["tenant", "reason"])
        for label, u in usage:
            prompt.add_metric([label], u.prompt_tokens)
            gen.add_metric([label], u.generated_tokens)
            cum, buckets = 0, []
            for bound, n in zip(QUEUE_BUCKETS, u.queue_buckets):
                cum += n
                buckets.append((_bucket(bound), cum))
            buckets.append(("+Inf", u.queue_count))
            queue.add_metric([label], buckets, u.queue_seconds)
            for reason in ("kv", "share"):
                pre.add_metric([label, reason], u.preempted.get(reason, 0))
        yield from (prompt, gen, queue, pre)
        total = CounterMetricFamily("lorafarm_preemptions", "Requests preempted, by reason (kv: recomputed; share: parked).",
                                    labels=["reason"])
        total.add_metric(["kv"], st.preemptions_kv)
        total.add_metric(["share"], st.preemptions_share)
        yield total
        counter = GaugeMetricFamily("lorafarm_tenant_fair_counter", "Fairness counter (weighted prompt + decode "
                                    "tokens served / weight) of each active named tenant.", labels=["tenant"])
        rows = GaugeMetricFamily("lorafarm_tenant_rows", "Batch rows held per active tenant.", labels=["tenant"])
        share = GaugeMetricFamily("lorafarm_tenant_rows_share", "Batch rows an active tenant is entitled to "
                                  "(max_batch split by weight among active tenants).", labels=["tenant"])
        waiting = GaugeMetricFamily("lorafarm_tenant_waiting", "Requests waiting for a row per active tenant.",
                                    labels=["tenant"])
        agg = {"rows": 0, "share": 0.0, "waiting": 0}
        others = False
        for a in rep.active:
            if a.client in rep.named:
                label = tenant_label(a.client)
                counter.add_metric([label], a.counter)
                rows.add_metric([label], a.held)
                share.add_metric([label], a.share)
                waiting.add_metric([label], a.waiting)
            else:
                others = True
                agg["rows"] += a.held
                agg["share"] += a.share
                agg["waiting"] += a.waiting
        if others:
            rows.add_metric([TENANT_OTHER], agg["rows"])
            share.add_metric([TENANT_OTHER], agg["share"])
            waiting.add_metric([TENANT_OTHER], agg["waiting"])
        active = GaugeMetricFamily("lorafarm_fair_tenants_active", "Tenants with requests waiting or in the batch.")
        active.add_metric([], len(rep.active))
        spread = GaugeMetricFamily("lorafarm_fair_counter_spread", "Largest minus least fairness counter among "
                                   "the active tenants (VTC keeps it bounded for backlogged tenants).")
        spread.add_metric([], (rep.active[-1].counter - rep.active[0].counter) if rep.active else 0.0)
        yield from (counter, rows, share, waiting, active, spread)


def _bucket(bound: float) -> str:
    return repr(float(bound))


class ReplicaMetrics:
    """Every collector the replica exports. Labels: `tier` is where the request's adapter was when the
    request arrived (gpu | ram | disk | remote, `gpu` for base-model requests)."""

    def __init__(self, replica_id: str = "r0", model_name: str = ""):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.replica_id = replica_id
        self.time_to_first_token = Histogram(
            "lorafarm_time_to_first_token_seconds", "Time to first token (arrival to first token).",
            ["tier"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "lorafarm_inter_token_latency_seconds", "Time between consecutive output tokens.",
            ["tier"], buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "lorafarm_e2e_request_latency_seconds", "Arrival to last token.",
            ["tier"], buckets=E2E_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            "lorafarm_request_queue_time_seconds",
            "Arrival until the request is handed to the engine (adapter load + queue).",
            ["tier"], buckets=TTFT_BUCKETS, registry=r)
        self.requests = Counter(
            "lorafarm_requests", "Finished requests by tier and finish reason.",
            ["tier", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("lorafarm_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("lorafarm_generation_tokens", "Tokens generated.", registry=r)
        self.num_requests_running = Gauge(
            "lorafarm_num_requests_running", "Requests in the running batch.", registry=r)
        self.num_requests_waiting = Gauge(
            "lorafarm_num_requests_waiting",
            "Requests waiting: for their adapter to load or for room in the batch.", registry=r)
        self.tokens_in_flight = Gauge(
            "lorafarm_tokens_in_flight",
            "Work in flight: unprefilled prompt tokens + tokens still to generate (autoscaling metric).",
            registry=r)
        self.kv_cache_usage_perc = Gauge(
            "lorafarm_kv_cache_usage_perc", "Fraction of the KV cache in use (0-1).", registry=r)
        self.decode_attention_paged = Gauge(
            "lorafarm_decode_attention_paged",
            "1 when decode attention reads the paged KV cache in place (the compiled kernel), 0 when it "
            "gathers each bucket's blocks (--attention; auto decides at startup).",
            registry=r)
        self.decode_steps_c = Gauge(
            "lorafarm_decode_steps_c",
            "Decode steps run by the C decode step since the replica started (handler/model/decode_step.py); "
            "stays 0 where it does not apply (the log line 'decode steps of 1-64 rows' says why).",
            registry=r)
        self.adapter_slot_hits = Counter(
            "lorafarm_adapter_slot_hits", "Requests whose adapter was already in a device slot.", registry=r)
        self.adapter_slot_misses = Counter(
            "lorafarm_adapter_slot_misses", "Requests whose adapter had to be loaded into a slot.",
            ["tier"], registry=r)
        self.adapter_loads = Counter(
            "lorafarm_adapter_loads", "Adapter loads into a device slot, by source tier and outcome.",
            ["tier", "outcome"], registry=r)
        self.adapter_load_latency = Histogram(
            "lorafarm_adapter_load_seconds", "Adapter load latency into a device slot, by source tier.",
            ["tier"], buckets=LOAD_BUCKETS, registry=r)
        self.adapter_evictions = Counter(
            "lorafarm_adapter_evictions", "Adapters evicted, by tier they were evicted from.",
            ["tier"], registry=r)
        self.adapters_resident = Gauge(
            "lorafarm_adapters_resident", "Adapters held per tier.", ["tier"], registry=r)
        self.tier_bytes = Gauge(
            "lorafarm_adapter_tier_bytes", "Bytes held by the RAM and disk tiers.", ["tier"], registry=r)
        self.loads_per_min_gauge = Gauge(
            "lorafarm_adapter_loads_per_min", "Device-slot loads over the last minute.", registry=r)
        self.evictions_per_min_gauge = Gauge(
            "lorafarm_adapter_evictions_per_min", "Device-slot evictions over the last minute.", registry=r)
        self.evicted_in_use = Counter(
            "lorafarm_adapter_evictions_in_use",
            "Evictions of an adapter that had running requests (must stay 0).", registry=r)
        self.prefetch_hits = Counter(
            "lorafarm_adapter_prefetch_hits",
            "Requests whose adapter a prefetch (popularity or owner pull) had brought in, by tier found.",
            ["tier"], registry=r)
        self.bytes_moved = Counter(
            "lorafarm_adapter_bytes_moved",
            "Adapter bytes moved, by the tier they came from (remote: fetched, disk: read, ram: copied "
            "into a slot).", ["tier"], registry=r)
        self.vllm = VllmMetrics(r, model_name or "unknown")
        self.load_rate = RateWindow()
        self.eviction_rate = RateWindow()
        # pre-create label sets so dashboards see zeros rather than missing series
        for t in TIERS:
            self.adapter_evictions.labels(tier=t)
            self.adapter_slot_misses.labels(tier=t)
            for o in ("ok", "error"):
                self.adapter_loads.labels(tier=t, outcome=o)

    def record_load(self, tier: str, seconds: float, ok: bool) -> None:
        self.adapter_loads.labels(tier=tier, outcome="ok" if ok else "error").inc()
        if ok:
            self.adapter_load_latency.labels(tier=tier).observe(seconds)
            self.load_rate.add()

    def record_eviction(self, tier: str, in_use: bool = False) -> None:
        self.adapter_evictions.labels(tier=tier).inc()
        if tier == "gpu":
            self.eviction_rate.add()
        if in_use:
            self.evicted_in_use.inc()

    def loads_per_min(self) -> float:
        return self.load_rate.per_minute()

    def evictions_per_min(self) -> float:
        return self.eviction_rate.per_minute()

    def watch_grammar(self, handler) -> None:
        """Export the handler's grammar pool and cache (read at each scrape)."""
        if not getattr(self, "_grammar_watched", False):
            self.registry.register(GrammarCollector(handler))
            self._grammar_watched = True

    def watch_prefix_cache(self, handler) -> None:
        """Export the engine's prefix cache counters (read at each scrape)."""
        if not getattr(self, "_prefix_watched", False):
            self.registry.register(PrefixCacheCollector(handler, self.vllm.model_name))
            self._prefix_watched = True

    def watch_tenants(self, handler) -> None:
        """Export the engine's per-tenant fair scheduling counters (read at each scrape)."""
        if not getattr(self, "_tenants_watched", False):
            self.registry.register(TenantCollector(handler, self.vllm.model_name))
            self._tenants_watched = True

    def watch_speculation(self, handler) -> None:
        """Export the engine's speculative decoding counters (read at each scrape)."""
        if not getattr(self, "_speculation_watched", False):
            self.registry.register(SpeculationCollector(handler, self.vllm.model_name))
            self._speculation_watched = True

    def render(self) -> bytes:
        self.loads_per_min_gauge.set(self.loads_per_min())
        self.evictions_per_min_gauge.set(self.evictions_per_min())
        self.vllm.copy_gauges(self)
        return generate_latest(self.registry)


class VllmMetrics:
    """The same measurements under vLLM's own names and `model_name` label (vLLM v1: `vllm:` prefix,
    model_name = the served base model), so dashboards and alerts written for vLLM apply unchanged.
    Requests for adapters count under the base model's name, as in vLLM."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent waiting in the queue.",
                               labels, buckets=TTFT_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                              registry=r)
        for m in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens,
                  self.running, self.waiting, self.kv_usage):
            m.labels(model_name)
        for reason in ("stop", "length"):
            self.success.labels(model_name, reason)

    def copy_gauges(self, m: ReplicaMetrics) -> None:
        for ours, theirs in ((m.num_requests_running, self.running), (m.num_requests_waiting, self.waiting),
                             (m.kv_cache_usage_perc, self.kv_usage)):
            theirs.labels(self.model_name).set(ours._value.get())


class RequestTimer:
    """Per-request timestamps feeding the latency histograms."""

    __slots__ = ("metrics", "tier", "arrival", "scheduled", "first_token", "last_token")

    def __init__(self, metrics: ReplicaMetrics | None, tier: str):
        self.metrics = metrics
        self.tier = tier
        self.arrival = time.perf_counter()
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None

    def on_scheduled(self) -> None:
        self.scheduled = time.perf_counter()
        if self.metrics:
            self.metrics.request_queue_time.labels(tier=self.tier).observe(self.scheduled - self.arrival)
            v = self.metrics.vllm
            v.queue.labels(v.model_name).observe(self.scheduled - self.arrival)

    def on_token(self) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            if self.metrics:
                self.metrics.time_to_first_token.labels(tier=self.tier).observe(now - self.arrival)
                v = self.metrics.vllm
                v.ttft.labels(v.model_name).observe(now - self.arrival)
        elif self.metrics and self.last_token is not None:
            self.metrics.inter_token_latency.labels(tier=self.tier).observe(now - self.last_token)
            v = self.metrics.vllm
            v.itl.labels(v.model_name).observe(now - self.last_token)
        self.last_token = now

    def on_finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if not self.metrics:
            return
        now = time.perf_counter()
        self.metrics.e2e_request_latency.labels(tier=self.tier).observe(now - self.arrival)
        self.metrics.requests.labels(tier=self.tier, finish_reason=finish_reason or "unknown").inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(completion_tokens)
        v = self.metrics.vllm
        v.e2e.labels(v.model_name).observe(now - self.arrival)
        v.success.labels(v.model_name, finish_reason or "unknown").inc()
        v.prompt_tokens.labels(v.model_name).inc(prompt_tokens)
        v.generation_tokens.labels(v.model_name).inc(completion_tokens)
        if self.first_token is not None and completion_tokens > 1:
            v.tpot.labels(v.model_name).observe((now - self.first_token) / (completion_tokens - 1))
