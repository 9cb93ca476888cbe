"""The router's Litestar app: `create_app(settings)`.

Public API (OpenAI-compatible): `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models`, `GET /health`, `GET /metrics`. Every /v1 call needs
`Authorization: Bearer <tenant API key>`.

The lifespan starts four loops: the registry routing table (every `routing_poll_interval`, with
its ETag, so an alias deploy or rollback is in use within about one interval), the replica state
poller (every `poll_interval`), the per-adapter stats pusher (every `stats_window`) and the SLO
evaluator. Everything lives on one `RouterCore` at `app.state.core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import re
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream

from lorafarm.registry_client import RegistryClient
from router.auth import AuthCache, AuthUnavailable, InvalidApiKey, Tenant
from router.catalog import Catalog, ModelNotFound, Resolved
from router.config import RouterSettings
from router.metrics import CANCELLED, CLIENT_ERROR, ERROR, OK, RouterMetrics
from router.openai_api import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    UPSTREAM_PATH,
    ApiError,
    ParsedRequest,
    parse_request_off_loop,
)
from router.poison import PoisonGuard, fingerprint
from router.proxy import STARTING_RETRY_AFTER_S, Failed, Opened, Proxy, UsageScanner, make_http_client
from router.ratelimit import make_limiter
from router.routing import RankedReplica, RouteRequest, choose
from router.slo import SloTracker
from router.stats import StatsAccumulator
from router.view import ReplicaView
from router.workers import ForeignWorkers, openai_error_body

log = logging.getLogger("lorafarm.router")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
access_log = logging.getLogger("lorafarm.router.access")


class RouterCore:
    """The router's state and its request path; the Litestar handlers are thin wrappers."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        registry: RegistryClient | None = None,
        http: httpx.AsyncClient | None = None,
    ):
        self.settings = s = settings
        self.metrics = RouterMetrics()
        self.metrics.price_per_replica_hour.set(settings.price_per_replica_hour)
        self._own_http = http is None
        self.http = http or make_http_client(s.max_connections,
                                             httpx.Timeout(s.read_timeout, connect=s.connect_timeout))
        self._own_registry = registry is None
        self.registry = registry or RegistryClient(s.registry_url, s.admin_token, timeout=s.registry_timeout)
        self.view = ReplicaView(
            self.http,
            admin_token=s.admin_token,
            health_failures=s.health_failures,
            state_timeout=s.state_timeout,
            health_timeout=s.health_timeout,
            load_threshold_tokens=s.load_threshold_tokens,
            load_threshold_queue=s.load_threshold_queue,
            metrics=self.metrics,
        )
        self.workers = ForeignWorkers(self.http, health_failures=s.health_failures, timeout=s.state_timeout)
        self.critical_models: list[str] = []
        self.catalog = Catalog(self.view, default_owners_k=s.default_owners_k)
        self.catalog.workers = self.workers
        self.auth = AuthCache(
            self._verify_key,
            ttl=s.auth_ttl,
            negative_ttl=s.auth_negative_ttl,
            stale_grace=s.auth_stale_grace,
        )
        self.limiter = make_limiter(s.redis_url, s.burst_seconds)
        self.slo = SloTracker(
            target=s.slo_ttft_target,
            window=s.slo_window,
            min_samples=s.slo_min_samples,
            on_update=self.metrics.set_tenant_slo,
        )
        self.stats = StatsAccumulator()
        self.proxy = Proxy(
            self.http,
            admin_token=s.admin_token,
            max_attempts=s.max_attempts,
            connect_timeout=s.connect_timeout,
            first_byte_timeout=s.first_byte_timeout,
            read_timeout=s.read_timeout,
            non_stream_timeout=s.non_stream_timeout,
            health_timeout=s.health_timeout,
            death_retries=s.death_retries,
            guard=PoisonGuard(threshold=s.poison_threshold, cooloff=s.poison_cooloff),
            probe_alive=self._probe_alive,
            on_death=lambda rid, phase: self.metrics.replica_deaths.labels(phase).inc(),
            is_responsive=self.view.is_responsive,
            on_failure=self._mark_failure,
            on_success=self._mark_success,
            upstream_headers=self._upstream_headers,
            on_failover=lambda reason: self.metrics.failovers.labels(reason).inc(),
        )
        self.rng = random.Random()
        self.etag: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._registry_down_logged = False
        self._stats_since = time.monotonic()
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"
        self._misses: dict[str, float] = {}  # unknown model name -> until when it is not refetched
        self._miss_task: asyncio.Future | None = None
        self._miss_started = 0.0

    def admin_ok(self, authorization: str | None) -> bool:
        import hmac

        token = self.settings.admin_token
        scheme, _, value = (authorization or "").partition(" ")
        return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    async def _verify_key(self, api_key: str) -> dict | None:
        self.metrics.registry_calls.labels("auth").inc()
        return await self.registry.verify_api_key(api_key)

    # -- background loops ----------------------------------------------------------------------

    async def refresh_routing(self, wait: float = 0.0, kind: str = "routing") -> bool:
        """One routing-table poll (a long poll with `wait` > 0); True when a new table was applied.
        The poll names this router and the version it has applied, which is how the registry knows
        when a deploy is in use here (DESIGN.md section 7: read-your-writes)."""
        self.metrics.registry_calls.labels(kind).inc()
        try:
            table, etag = await self.registry.routing_table(self.etag, wait=wait, router_id=self.router_id)
        except Exception as e:
            self.metrics.registry_errors.labels("routing").inc()
            self.metrics.registry_reachable.set(0)
            self.auth.registry_failed()
            if not self._registry_down_logged:
                log.warning("routing table unavailable from the registry (%s); keeping the last one", e)
                self._registry_down_logged = True
            return False
        self.metrics.registry_reachable.set(1)
        self.auth.registry_answered()  # verified keys serve through an outage counted from here (router/auth.py)
        if self._registry_down_logged:
            log.info("registry reachable again")
            self._registry_down_logged = False
        if table is None:
            return False
        version, current = table.get("version"), self.view.table.version
        if isinstance(version, int) and isinstance(current, int) and version < current:
            return False  # a slower concurrent poll: never go back to an older table
        self.view.apply_table(table)
        self._misses.clear()
        self.workers.apply(table.get("workers"))
        self.critical_models = [str(m) for m in table.get("critical_models") or ()]
        self.auth.revoke_key_ids(self.view.table.revoked_key_ids)
        self.etag = etag
        if self.view.table.version is not None:
            with contextlib.suppress(TypeError, ValueError):
                self.metrics.routing_version.set(float(self.view.table.version))
        log.debug("routing table version %s applied", self.view.table.version)
        return True

    async def _routing_loop(self) -> None:
        """Long-poll the routing table: a change is applied within one registry round trip, and the
        next poll (sent at once) tells the registry it is applied. Plain polling every
        `routing_poll_interval` when the registry answers at once or is unreachable."""
        s = self.settings
        while True:
            started = time.monotonic()
            # while the registry is unreachable, poll plainly: a long poll to a registry that just
            # came back would hold the answer (and /health's "degraded") until the table changes
            wait = 0.0 if self._registry_down_logged else s.routing_long_poll
            try:
                if await self.refresh_routing(wait=wait):
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("router routing loop failed; continuing")
            await asyncio.sleep(max(0.0, s.routing_poll_interval - (time.monotonic() - started)))

    async def refresh_for_miss(self, model: str) -> bool:
        """A request named a model the routing table does not know: fetch the table once before
        answering 404, so a deploy is usable the moment its registry call returns. Single flight
        (concurrent misses share one fetch that started after they arrived), at most one fetch per
        0.1 s, and a name still unknown afterwards is not refetched for `miss_negative_ttl` s.
        True when a fetch ran (the caller resolves again)."""
        now = time.monotonic()
        if self._misses.get(model, 0.0) > now:
            return False
        arrived = now
        while True:
            task = self._miss_task
            if task is not None and not task.done():
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
                if self._miss_started >= arrived:
                    break
                continue  # that fetch began before this request: it may predate the deploy
            gap = self._miss_started + 0.1 - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)
                continue
            self._miss_started = time.monotonic()
            self._miss_task = asyncio.ensure_future(self.refresh_routing(kind="routing_miss"))
        if len(self._misses) > 10_000:
            self._misses.clear()
        self._misses[model] = time.monotonic() + self.settings.miss_negative_ttl
        return True

    async def _every(self, interval: float, fn, name: str) -> None:
        while True:
            started = time.monotonic()
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("router %s loop failed; continuing", name)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _push_stats(self) -> None:
        now = time.monotonic()
        window = now - self._stats_since  # the real window, not the nominal one
        try:
            if await self.stats.push(self.registry.push_stats, round(window, 3)):
                self._stats_since = now
        except Exception:
            self.metrics.registry_errors.labels("stats").inc()
        try:  # per-version counts of split aliases: what the registry's rollouts judge
            await self.metrics.versions.push(
                lambda w, rows: self.registry.push_version_stats(w, rows, router_id=self.router_id))
        except Exception:
            self.metrics.registry_errors.labels("version_stats").inc()

    def _version_outcome(self, resolved: Resolved, outcome: str, **kw) -> None:
        """Count one request of a split alias against the version that took it (router/metrics.py)."""
        if resolved.split and resolved.alias and resolved.adapter_id:
            self.metrics.versions.record(resolved.alias, resolved.adapter_id, outcome, **kw)

    async def _poll_states(self) -> None:
        wait = self.settings.poll_interval * 0.9
        await asyncio.gather(self.view.poll_states(wait=wait), self.workers.poll(wait=wait))
        self.metrics.observe_critical(self.critical_holders())

    async def _evaluate_slo(self) -> None:
        self.slo.evaluate()

    async def start(self) -> None:
        s = self.settings
        # first table and states before serving, bounded so an absent registry does not block start-up
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(2.0, s.registry_timeout)):
                if await self.refresh_routing():
                    await asyncio.gather(self.view.poll_states(), self.workers.poll())
        self._tasks = [
            asyncio.create_task(self._routing_loop()),
            asyncio.create_task(self._every(s.poll_interval, self._poll_states, "state")),
            asyncio.create_task(self._every(s.stats_window, self._push_stats, "stats")),
            asyncio.create_task(self._every(s.slo_eval_interval, self._evaluate_slo, "slo")),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.view.cancel_polls()
        self.workers.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._push_stats(), timeout=2.0)  # the last partial window
        if self._own_registry:
            await self.registry.aclose()
        if self._own_http:
            await self.http.aclose()

    # -- request path --------------------------------------------------------------------------

    async def authenticate(self, request: Request) -> Tenant:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401,
                "You didn't provide an API key. Pass it as 'Authorization: Bearer YOUR_KEY'.",
                code="invalid_api_key",
            )
        try:
            return await self.auth.tenant_for(key.strip())
        except InvalidApiKey:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key") from None
        except AuthUnavailable as e:
            raise ApiError(503, str(e), type_="server_error", code="auth_unavailable") from None

    def models(self, tenant: Tenant) -> dict:
        return self.catalog.models_for(tenant.tenant_id)

    def model(self, tenant: Tenant, model: str) -> dict:
        try:
            return self.catalog.model_for(tenant.tenant_id, model)
        except ModelNotFound as e:
            raise ApiError(404, str(e), code="model_not_found", param="model") from None

    def route(self, resolved: Resolved, tokens: int) -> list[RankedReplica]:
        rr = RouteRequest(
            adapter_id=resolved.adapter_id,
            base_model_hash=resolved.base_model_hash,
            model_name=resolved.base_model_name if resolved.kind == "base" else None,
            owners_k=resolved.owners_k,
            tokens=tokens,
        )
        return choose(
            rr,
            self.snapshot(),
            self.settings.strategy,
            resolved.owners_k,
            affinity=self.settings.affinity,
            rng=self.rng if self.settings.strategy == "random" else None,
        )

    # -- lorafarm replicas and foreign workers, side by side ----------------------------------

    def snapshot(self):
        """The view's replicas plus the foreign workers: what `choose()` ranks."""
        snap = self.view.snapshot()
        return dataclasses.replace(snap, replicas=snap.replicas + self.workers.snapshots(), score=self.settings.score)

    def _acquire(self, replica_id: str, tokens: int) -> None:
        self.view.acquire(replica_id, tokens)
        self.workers.acquire(replica_id, tokens)

    def _release(self, replica_id: str, tokens: int) -> None:
        self.view.release(replica_id, tokens)
        self.workers.release(replica_id, tokens)

    def _mark_failure(self, replica_id: str, why: str = "") -> None:
        self.view.mark_failure(replica_id, why)
        self.workers.mark_failure(replica_id, why)

    def _mark_success(self, replica_id: str) -> None:
        self.view.mark_success(replica_id)
        self.workers.mark_success(replica_id)

    async def _probe_alive(self, ranked: RankedReplica) -> bool:
        """After a connection broke mid-request: is the replica's process still there? A foreign
        worker is not probed (its health path is its own): a break there counts as a death."""
        if self.workers.is_worker(ranked.replica_id):
            return False
        return await self.proxy._probe_health(ranked)

    def _deadline(self, request: Request, stream: bool) -> float | None:
        """The loop time by which the whole request must be done: the client's `x-request-timeout`
        (seconds, at most `max_request_timeout`), else `non_stream_timeout` for a non-streamed request
        and none for a stream (a stream is bounded by silence, `read_timeout`)."""
        raw = request.headers.get("x-request-timeout")
        seconds: float | None = None
        if raw:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = None
            if seconds is None or not seconds > 0 or seconds != seconds:
                raise ApiError(400, "x-request-timeout must be a positive number of seconds.",
                               code="invalid_request_timeout", param="x-request-timeout")
            seconds = min(seconds, self.settings.max_request_timeout)
        elif not stream:
            seconds = self.settings.non_stream_timeout
        return None if seconds is None else asyncio.get_running_loop().time() + seconds

    def _upstream_headers(self, replica_id: str, headers: dict[str, str]) -> dict[str, str]:
        return self.workers.headers_for(replica_id, headers) if self.workers.is_worker(replica_id) else headers

    def critical_holders(self) -> dict[str, int]:
        """Each latency-critical model -> how many healthy workers (replicas or foreign) hold it."""
        snaps = [r for r in self.snapshot().replicas if r.healthy]
        return {m: sum(1 for r in snaps if m in r.models) for m in self.critical_models}

    def _task_ok(self, replica_id: str, endpoint: str) -> bool:
        """Embedding workers take only /v1/embeddings, generating replicas everything else; a worker
        whose task is unknown (no state yet, foreign) may take either."""
        e = self.view.replicas.get(replica_id)
        if e is None or e.state is None:
            return True
        return (e.state.task == "embed") == (endpoint == EMBEDDINGS)

    async def completion(self, request: Request, endpoint: str) -> Response:
        request_id = request.headers.get("x-request-id", "")
        if not _REQUEST_ID.fullmatch(request_id):  # the client's id only when it is a plain token
            request_id = f"req-{uuid.uuid4().hex[:20]}"
        try:
            return await self._completion(request, endpoint, request_id)
        except ApiError as e:
            # refused at the gateway (auth, validation, rate limit, unknown model, no replica)
            self.metrics.requests.labels(endpoint, str(e.status), "none").inc()
            if e.status != 429:  # 429s are logged where they are decided
                access_log.info(
                    "request_id=%s status=%d code=%s path=%s: %s",
                    request_id, e.status, e.code, request.url.path, _printable(e.message),
                )  # fmt: skip
            e.headers.setdefault("x-request-id", request_id)
            raise

    async def _completion(self, request: Request, endpoint: str, request_id: str) -> Response:
        arrived = time.perf_counter()
        tenant = await self.authenticate(request)
        parsed = await parse_request_off_loop(endpoint, await request.body(), self.settings.default_max_tokens)
        deadline = self._deadline(request, parsed.stream)
        limit = self.limiter.check(
            tenant.tenant_id,
            requests_per_s=tenant.requests_per_s or self.settings.default_requests_per_s,
            tokens_per_s=tenant.tokens_per_s or self.settings.default_tokens_per_s,
            tokens=parsed.cost,
        )
        if not limit.allowed:
            self.metrics.rate_limited.inc()
            access_log.info(
                "request_id=%s tenant=%s model=%s status=429 rate_limited retry_after=%.2f",
                request_id, tenant.tenant_id, _printable(parsed.model), limit.retry_after,
            )  # fmt: skip
            raise ApiError(
                429,
                f"Rate limit reached for tenant {tenant.tenant_id}; retry after {limit.headers['retry-after']} s.",
                type_="rate_limit_error",  # what OpenAI clients map to RateLimitError with the 429
                code="rate_limit_exceeded",
                headers=limit.headers,
            )
        user = _end_user(request, parsed.body)  # a split alias gives the same user the same version
        try:
            try:
                resolved = self.catalog.resolve(tenant.tenant_id, parsed.model, user, self.rng)
            except ModelNotFound:
                if not await self.refresh_for_miss(parsed.model):
                    raise
                resolved = self.catalog.resolve(tenant.tenant_id, parsed.model, user, self.rng)
        except ModelNotFound as e:
            self.limiter.settle(tenant.tenant_id, parsed.cost, 0)
            access_log.info("request_id=%s tenant=%s model=%s status=404 model_not_found",
                            request_id, tenant.tenant_id, _printable(parsed.model))  # fmt: skip
            raise ApiError(404, str(e), code="model_not_found", param="model", headers=limit.headers) from None
        wrong = self.catalog.wrong_endpoint(resolved, endpoint == EMBEDDINGS)
        if wrong is not None:  # an embedding model sent to chat or the reverse: the client's mistake
            self.limiter.settle(tenant.tenant_id, parsed.cost, 0)
            raise ApiError(400, wrong[0], code=wrong[1], param="model", headers=limit.headers)
        ranked = [r for r in self.route(resolved, parsed.cost) if self._task_ok(r.replica_id, endpoint)]
        body = dict(parsed.body)
        body["model"] = resolved.upstream_model
        payload = json.dumps(body, separators=(",", ":")).encode()

        base_headers = {"x-request-id": request_id, **limit.headers}
        if resolved.adapter_id:
            base_headers["x-adapter-id"] = resolved.adapter_id
        fp = fingerprint(tenant.tenant_id, endpoint, body)
        if self.proxy.guard.refused_for(fp):
            self.limiter.settle(tenant.tenant_id, parsed.cost, 0)
            self.metrics.poison_requests.labels("refused").inc()
            log.warning("poison request refused: request_id=%s tenant=%s fingerprint=%s (in flight when %s died, "
                        "never completed since)", request_id, tenant.tenant_id, fp, self.proxy.guard.describe(fp))
            refusal = self.proxy.poison_failed(request_id, tenant.tenant_id, fp, [], 0)
            raise ApiError(400, json.loads(refusal.body)["error"]["message"], code="poison_request",
                           headers={**base_headers, "retry-after": refusal.headers["retry-after"]})
        if not ranked:
            self.limiter.settle(tenant.tenant_id, parsed.cost, 0)
            self._version_outcome(resolved, ERROR, kind="unavailable")
            if starting := self.view.starting():  # not "no replica": say which are on their way, and when to retry
                raise ApiError(
                    503,
                    f"No replica serves the model `{parsed.model}` yet: {', '.join(starting)} still starting; "
                    f"retry in {STARTING_RETRY_AFTER_S} s.",
                    type_="server_error",
                    code="replicas_starting",
                    headers={**base_headers, "retry-after": str(STARTING_RETRY_AFTER_S)},
                )
            raise ApiError(
                503,
                f"No replica serves the model `{parsed.model}` right now.",
                type_="server_error",
                code="replica_unavailable",
                headers=base_headers,
            )

        # count the request against its first choice at once, so concurrent routing sees it
        first = ranked[0].replica_id
        self._acquire(first, parsed.cost)
        self.metrics.in_flight.inc()
        try:
            # a client that hangs up before the answer is ready cancels it (the upstream request is
            # closed, which cancels the generation on the replica): streamed or not
            outcome = await _unless_disconnected(
                request,
                self.proxy.open(
                    ranked,
                    UPSTREAM_PATH[endpoint],
                    payload,
                    request_id=request_id,
                    tenant_id=tenant.tenant_id,
                    read_whole_body=not parsed.stream,
                    model_name=parsed.model,
                    fingerprint=fp,
                    deadline=deadline,
                    tenant_weight=tenant.weight,
                ),
            )
        except BaseException as e:
            self._release(first, parsed.cost)
            self.metrics.in_flight.dec()
            if isinstance(e, ApiError) and e.status == 499:
                self._version_outcome(resolved, CANCELLED)
            raise
        if isinstance(outcome, Failed):
            failed_as, failed_kw = _failed_outcome(outcome)
            self._version_outcome(resolved, failed_as, **failed_kw)
            if outcome.code == "poison_request":
                self.metrics.poison_requests.labels("stopped").inc()
                log.warning("poison request stopped: request_id=%s tenant=%s fingerprint=%s replicas died with it: "
                            "%s", request_id, tenant.tenant_id, fp, ", ".join(outcome.tried))
            elif outcome.code == "request_timeout":
                self.metrics.deadline_exceeded.inc()
            self._release(first, parsed.cost)
            self.metrics.in_flight.dec()
            self.limiter.settle(tenant.tenant_id, parsed.cost, 0)
            e2e = time.perf_counter() - arrived
            self.metrics.requests.labels(endpoint, str(outcome.status_code), "none").inc()
            self.metrics.record_usage(tenant.tenant_id, outcome.status_code, 0, 0, None)
            self._log(request_id, tenant, parsed, resolved, None, outcome.status_code, "none", None, e2e,
                      attempts=outcome.attempts)  # fmt: skip
            headers = {**outcome.headers, **base_headers}
            content = outcome.body
            if outcome.tried and self.workers.is_worker(outcome.tried[-1]):
                content = openai_error_body(outcome.status_code, content)
                headers["content-type"] = "application/json"
            return Response(
                content=content,
                status_code=outcome.status_code,
                headers=headers,
                media_type=outcome.headers.get("content-type", "application/json"),
            )
        # the replica that answered may differ from the first choice: move the in-flight count
        if outcome.ranked.replica_id != first:
            self._release(first, parsed.cost)
            self._acquire(outcome.ranked.replica_id, parsed.cost)
        return await self._respond(outcome, request_id, tenant, parsed, resolved, base_headers, arrived, endpoint)

    async def _respond(
        self,
        opened: Opened,
        request_id: str,
        tenant: Tenant,
        parsed: ParsedRequest,
        resolved: Resolved,
        base_headers: dict[str, str],
        arrived: float,
        endpoint: str,
    ) -> Response:
        if opened.status_code >= 400 and self.workers.is_worker(opened.ranked.replica_id):
            await self._foreign_error(opened)
        tier = opened.response.headers.get("x-adapter-tier") or ("base" if resolved.kind == "base" else "unknown")
        route_class = opened.ranked.route_class
        headers = opened.passthrough_headers()
        headers.update(base_headers)
        headers["x-replica-id"] = opened.ranked.replica_id
        headers["x-route-class"] = route_class
        if resolved.adapter_id:
            headers["x-adapter-id"] = resolved.adapter_id  # the gateway's resolution is authoritative
        status = opened.status_code
        scanner = UsageScanner()
        replica_id = opened.ranked.replica_id

        def done(outcome: str) -> None:
            e2e = time.perf_counter() - arrived
            self._release(replica_id, parsed.cost)
            self.metrics.in_flight.dec()
            ok = outcome == "ok"
            if outcome == "upstream_error":
                self.metrics.stream_errors.inc()
            elif outcome == "deadline":
                self.metrics.deadline_exceeded.inc()
            label = str(status) if ok else outcome
            if ok and status < 400:  # relayed whole: evidence that this body does not kill replicas
                self.proxy.completed(opened.fingerprint)
            self.metrics.requests.labels(endpoint, label, route_class).inc()
            if status < 400 and ok:
                self.metrics.e2e.labels(tier, route_class).observe(e2e)
            if status < 400 and parsed.stream:
                # time to the first generated token (a replica may send an empty role chunk first)
                ttft = (scanner.first_token_at or opened.first_byte_at) - arrived
                self.metrics.ttft.labels(tier, route_class).observe(ttft)
                self.slo.record(tenant.tenant_id, ttft)
            usage = scanner.usage or {}
            if isinstance(usage.get("total_tokens"), int):
                actual = usage["total_tokens"]
            elif status < 400:
                actual = parsed.prompt_tokens + scanner.content_events
            else:
                actual = 0
            self.limiter.settle(tenant.tenant_id, parsed.cost, actual)
            prompt_t = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else (
                parsed.prompt_tokens if status < 400 else 0)
            self.metrics.record_usage(tenant.tenant_id, status if ok else 502, prompt_t,
                                      max(0, actual - prompt_t), resolved.adapter_id if status < 400 else None)
            if resolved.adapter_id and status < 400:
                self.stats.record(resolved.adapter_id, actual, gpu_hit=(tier == "gpu"))
            if resolved.split:
                if outcome in ("upstream_error", "deadline"):
                    vo, kind = ERROR, "stream_error" if outcome == "upstream_error" else "timeout"
                elif outcome == "client_closed":
                    vo, kind = CANCELLED, None
                else:
                    vo, kind = (OK if status < 400 else CLIENT_ERROR), None
                self._version_outcome(
                    resolved, vo, kind=kind,
                    ttft=((scanner.first_token_at or opened.first_byte_at) - arrived)
                    if parsed.stream and status < 400 and scanner.first_token_at is not None else None,
                    prompt_tokens=prompt_t if status < 400 else 0,
                    completion_tokens=max(0, actual - prompt_t) if status < 400 else 0,
                    finish_reasons=scanner.finish_reasons)
            ttft_log = ((scanner.first_token_at or opened.first_byte_at) - arrived) if parsed.stream else None
            self._log(request_id, tenant, parsed, resolved, opened.ranked, label, route_class, tier, e2e,
                      attempts=opened.attempts, ttft=ttft_log, tokens=actual)  # fmt: skip

        media_type = opened.response.headers.get("content-type", "application/json")
        if opened.streaming:
            headers.setdefault("cache-control", "no-cache")
            headers["x-accel-buffering"] = "no"
        headers.pop("content-type", None)
        if not parsed.stream:
            # the whole answer is already here (read before committing, for failover): send it
            # as one plain response with a Content-Length
            await opened.aclose()
            scanner.feed_json(opened.first)
            done("ok")
            return Response(content=opened.first, status_code=status, headers=headers, media_type=media_type)
        return Stream(
            content=self.proxy.relay(opened, scanner, done),
            status_code=status,
            headers=headers,
            media_type=media_type,
        )

    def _log(
        self,
        request_id: str,
        tenant: Tenant,
        parsed: ParsedRequest,
        resolved: Resolved,
        ranked: RankedReplica | None,
        status: int,
        route_class: str,
        tier: str | None,
        e2e: float,
        *,
        attempts: int,
        ttft: float | None = None,
        tokens: int | None = None,
    ) -> None:
        access_log.info(
            "request_id=%s tenant=%s model=%s adapter_id=%s replica=%s class=%s tier=%s status=%s "
            "attempts=%d stream=%s ttft_ms=%s e2e_ms=%.1f tokens=%s",
            request_id, tenant.tenant_id, _printable(parsed.model), resolved.adapter_id or "-",
            ranked.replica_id if ranked else "-", route_class, tier or "-", status, attempts,
            parsed.stream, f"{ttft * 1000:.1f}" if ttft is not None else "-", e2e * 1000,
            tokens if tokens is not None else "-",
        )  # fmt: skip

    async def _foreign_error(self, opened: Opened) -> None:
        """A foreign worker's 4xx answer, read whole and rewritten as an OpenAI error object (streamed
        requests too: an error is never an event stream)."""
        chunks = [opened.first]
        with contextlib.suppress(httpx.HTTPError, OSError):
            async for c in opened.rest:
                chunks.append(c)
        await opened.aclose()
        opened.first = openai_error_body(opened.status_code, b"".join(chunks))
        opened.streaming = False

        async def _empty():
            return
            yield b""  # pragma: no cover

        opened.rest = _empty()
        opened.response.headers["content-type"] = "application/json"

    def health(self) -> tuple[int, dict]:
        snap = self.snapshot()
        status = "starting" if not self.view.table_loaded else "degraded" if self._registry_down_logged else "ok"
        body = {
            "status": status,  # degraded: serving from the last routing table, the registry is unreachable
            "registry_reachable": not self._registry_down_logged,
            "routing_table_version": self.view.table.version,
            "replicas": len(snap.replicas),
            "replicas_healthy": sum(1 for r in snap.replicas if r.healthy),
            "replicas_possibly_warm": sum(1 for r in snap.replicas if r.healthy and not r.state_fresh),
            "strategy": self.settings.strategy,
            "workers": self.workers.status(),
        }
        holders = self.critical_holders()
        degraded = [{"model": m, "workers": n} for m, n in sorted(holders.items()) if n < 2]
        body["critical_models"] = [{"model": m, "workers": n} for m, n in sorted(holders.items())]
        body["degraded_models"] = degraded
        if degraded and status == "ok":
            body["status"] = "degraded"  # the two-workers rule: failover is not ready for these models
        return (200 if self.view.table_loaded else 503), body


def _end_user(request: Request, body: dict) -> str | None:
    """The end user a request names, for sticky version assignment: the x-lorafarm-user header, else
    OpenAI's `user` field (a non-empty string of at most 256 characters)."""
    user = request.headers.get("x-lorafarm-user")
    if not user:
        user = body.get("user") if isinstance(body.get("user"), str) else None
    return user[:256] if user else None


def _failed_outcome(failed: Failed) -> tuple[str, dict]:
    """(outcome, {kind}) of a request no replica answered, for the per-version metrics."""
    if failed.code == "request_timeout":
        return ERROR, {"kind": "timeout"}
    if failed.code == "replica_died":
        return ERROR, {"kind": "replica_died"}
    if failed.status_code == 429:
        return ERROR, {"kind": "upstream_429"}
    if failed.status_code >= 500:
        starting = failed.code == "replicas_starting"
        code = "unavailable" if failed.status_code == 503 and (starting or not failed.tried) else "upstream_5xx"
        return ERROR, {"kind": code}
    return CLIENT_ERROR, {}


async def _unless_disconnected(request: Request, coro):
    """Await `coro`; if the client disconnects first, cancel it and raise a 499 ApiError."""
    from lorafarm.serving import ClientGone, unless_disconnected

    try:
        return await unless_disconnected(request.receive, coro, discard=_close_opened)
    except ClientGone:
        raise ApiError(499, "The client closed the request.", code="client_closed") from None


async def _close_opened(result) -> None:
    if isinstance(result, Opened):  # a replica answered just as the client left
        await result.aclose()


def _printable(text: str, limit: int = 200) -> str:
    """Client-supplied text made safe for a one-line log record."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


# -- Litestar wiring ----------------------------------------------------------------------------


def _core(request: Request) -> RouterCore:
    return request.app.state.core


def _error_response(e: ApiError) -> Response:
    return Response(content=e.to_bytes(), status_code=e.status, headers=e.headers, media_type="application/json")


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    return await _core(request).completion(request, CHAT)


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    return await _core(request).completion(request, COMPLETIONS)


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request) -> Response:
    return await _core(request).completion(request, EMBEDDINGS)


@get("/v1/models")
async def list_models(request: Request) -> Response:
    core = _core(request)
    tenant = await core.authenticate(request)
    return Response(content=json.dumps(core.models(tenant)).encode(), media_type="application/json")


@get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    core = _core(request)
    tenant = await core.authenticate(request)
    entry = core.model(tenant, model_id.lstrip("/"))
    return Response(content=json.dumps(entry).encode(), media_type="application/json")


@get("/health")
async def health(request: Request) -> Response:
    status, body = _core(request).health()
    return Response(content=json.dumps(body).encode(), status_code=status, media_type="application/json")


@get("/metrics")
async def metrics(request: Request) -> Response:
    core = _core(request)
    return Response(content=core.metrics.render(), media_type=core.metrics.content_type)


@get("/internal/versions")
async def versions_summary(request: Request, alias: str | None = None) -> Response:
    """Per-version counts of split aliases since this router started (admin token): what its
    /metrics shows with alias and version labels, as a summary (rates, TTFT p50/p95)."""
    core = _core(request)
    if not core.admin_ok(request.headers.get("authorization")):
        raise ApiError(401, "missing or wrong admin token", code="invalid_admin_token")
    body = {"router_id": core.router_id, **core.metrics.versions.summary(alias)}
    return Response(content=json.dumps(body).encode(), media_type="application/json")


def _api_error_handler(request: Request, exc: ApiError) -> Response:
    return _error_response(exc)


def _http_error_handler(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 404:
        err = ApiError(404, f"Unknown path {request.url.path}", code="not_found")
    elif status == 405:
        err = ApiError(405, f"Method {request.method} not allowed on {request.url.path}", code="method_not_allowed",
                       headers={k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"})
    else:
        err = ApiError(status, str(exc.detail), type_="invalid_request_error" if status < 500 else "server_error")
    return _error_response(err)


def _internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(ApiError(500, "Internal error in the router.", type_="server_error", code="internal_error"))


def _OPENAPI_BODIES() -> dict:
    from lorafarm.openai_schemas import ChatCompletionRequest, CompletionRequest  # the shapes forwarded

    return {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def _openapi():
    from lorafarm.openapi import openapi_config

    return openapi_config(
        "lorafarm router", "OpenAI-compatible gateway in front of the replicas.", _OPENAPI_BODIES(),
        "a tenant API key",
    )


def create_app(
    settings: RouterSettings | None = None,
    *,
    registry: RegistryClient | None = None,
    http: httpx.AsyncClient | None = None,
) -> Litestar:
    """The router app. `registry`/`http` may be injected (tests); by default they are built from
    `settings` and closed at shutdown."""
    settings = settings or RouterSettings()
    core = RouterCore(settings, registry=registry, http=http)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await core.start()
        try:
            yield
        finally:
            await core.stop()

    app = Litestar(
        route_handlers=[chat_completions, completions, embeddings, list_models, get_model, health, metrics,
                        versions_summary],
        lifespan=[lifespan],
        exception_handlers={
            ApiError: _api_error_handler,
            HTTPException: _http_error_handler,
            Exception: _internal_error_handler,
        },
        openapi_config=_openapi(),
        logging_config=None,  # leave logging to the process (CLI) and to pytest
        debug=False,
    )
    app.state.core = core
    app.state.openapi_bodies = _OPENAPI_BODIES()
    return app
