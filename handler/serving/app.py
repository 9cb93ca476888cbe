"""The replica's HTTP service (Litestar on uvicorn): OpenAI-compatible completions through the
`LoraHandler` (`handler.serving.handler`: every step of a completion is there; the routes here only
read the request and answer), the internal load/unload/state API the router and registry use, health
and metrics.

    app = create_app(ReplicaConfig(replica_id="r0", base_dir=Path("models/dev")))

Start-up (lifespan): load the base and hash it, start the engine thread, open the adapter source
(registry + object store in production; a local catalog or nothing in standalone mode), join the
registry and heartbeat when one is configured, then pull the adapters this replica owns to disk and
RAM and pre-warm the first of them into device slots, in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from litestar.types import ASGIApp, Receive, Scope, Send

from archives.basehash import base_model_hash
from archives.extract import extract_archive
from archives.keys import load_public_keys
from archives.store import open_store
from handler.adapters.cache import AdapterLoadError, AdapterNotFoundError, CatalogSource, NoSource, RegistrySource
from handler.adapters.retire import Retirer
from handler.engine.fairness import clamp_weight
from handler.model import paged_attention, small_gemm
from handler.serving import holds
from handler.serving.config import Limits, ReplicaConfig
from handler.serving.handler import GenerationRequest, HandlerContext, LoraHandler, load_error_to_openai, not_ready
from handler.serving.metrics import CONTENT_TYPE, ReplicaMetrics
from handler.serving.startup import StartPhases, since_process_start
from lorafarm import openai_schemas as oai
from lorafarm.accesslog import access_log_middleware, quiet_polling_loggers
from lorafarm.openapi import openapi_config
from lorafarm.registry_client import RegistryClient, RegistryError
from lorafarm.serving import ClientGone, serve, unless_disconnected

__all__ = ["ReplicaConfig", "Limits", "ReplicaService", "create_app", "run", "AdminAuthMiddleware"]

log = logging.getLogger("lorafarm.replica")

PUBLIC_PATHS = ("/health", "/ready", "/metrics", "/schema/openapi.json")
OPENAPI_BODIES = {"/v1/chat/completions": oai.ChatCompletionRequest, "/v1/completions": oai.CompletionRequest}


# ------------------------------------------------------------------------------ errors and auth


def _json_response(status: int, body: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(content=body, status_code=status, media_type=MediaType.JSON, headers=headers or {})


def _openai_error_handler(_: Request, exc: oai.OpenAIError) -> Response:
    return _json_response(exc.status, exc.body(), exc.headers)


_HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type",
               429: "rate_limited"}


def _http_error_handler(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    msg = exc.detail or "error"
    if status == 413:
        msg = "The request body is too large."
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return _json_response(status, oai.error_body(str(msg), type=kind, code=_HTTP_CODES.get(status)),
                          dict(exc.headers or {}))


def _server_error_handler(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error: %s", exc)
    return _json_response(500, oai.error_body(f"internal error: {exc.__class__.__name__}", type="server_error",
                                              code="internal_error"))


class AdminAuthMiddleware:
    """Bearer admin token on every path but /health and /metrics (when a token is configured)."""

    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        auth = b""
        for k, v in scope.get("headers") or ():
            if k == b"authorization":
                auth = v
                break
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
            body = json.dumps(oai.error_body("Missing or invalid admin bearer token.",
                                             code="invalid_admin_token")).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------ the service


class ReplicaService:
    """What the lifespan builds and the routes use (kept on `app.state.replica`)."""

    def __init__(self, config: ReplicaConfig):
        self.config = config
        self.handler = LoraHandler()
        self.metrics = ReplicaMetrics(config.replica_id, config.resolved_model_name())
        self.registry = None
        self.store = None
        self.ready = False  # serving: started and not draining (the routes' front door, /health)
        self.joined = False
        self.tasks: list[asyncio.Task] = []
        self.pull_done = asyncio.Event()
        self.started_at = time.time()
        self.phases = StartPhases(self.metrics.registry)

    # -- start / stop -----------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        trusted = load_public_keys([str(p) for p in cfg.trust]) if cfg.trust else []
        if cfg.store_url:
            self.store = open_store(cfg.store_url, endpoint_url=cfg.s3_endpoint_url)
        if cfg.registry_url:
            self.registry = RegistryClient(cfg.registry_url, cfg.admin_token)
            source = RegistrySource(self.registry, self.store)
        elif cfg.adapter_catalog:
            if self.store is None:
                raise RuntimeError("--adapter-catalog needs --store-url (the catalog's URIs point into it)")
            source = CatalogSource.load(cfg.adapter_catalog, self.store)
        else:
            source = NoSource()
        ctx = HandlerContext(
            model_dir=Path(cfg.base_dir), model_name=cfg.resolved_model_name(), replica_id=cfg.replica_id,
            engine=cfg.engine, limits=cfg.limits, metrics=self.metrics, slots=cfg.slots, rank_pools=cfg.rank_pools,
            disk_dir=cfg.resolved_disk_dir(), ram_bytes=cfg.ram_bytes, disk_bytes=cfg.disk_bytes,
            load_nice=cfg.load_nice, trusted_keys=trusted, source=source, merged_adapter=cfg.merged_adapter)
        if cfg.merged_adapter:
            ctx.merged_adapter_dir = await self._fetch_merged(ctx, source, trusted)
        phases = self.phases
        if _on_cpu(cfg):
            with phases.phase("kernels"):  # the C kernels: built once per source and CPU into the kernel cache
                await asyncio.to_thread(small_gemm.library)
        compiled_before = paged_attention.compile_seconds
        t0, c0 = time.monotonic(), time.process_time()
        await asyncio.to_thread(self.handler.initialize, ctx)  # config, tokenizer, weights, engine buffers
        compiled = paged_attention.compile_seconds - compiled_before  # the paged kernel's, inside the engine
        if compiled:
            phases.add("kernels", compiled)
        phases.add("weights", time.monotonic() - t0 - compiled, time.process_time() - c0)
        with phases.phase("warm-up"):  # the adapter cache, the grammar workers and tokenizer tables
            await self.handler.start()
        phases.done()
        self.ready = True
        if cfg.prefetch_interval_s > 0 and not cfg.merged_adapter:
            self.tasks.append(asyncio.create_task(self._prefetch_loop(), name="prefetch"))
        if self.registry is not None:
            self.tasks.append(asyncio.create_task(self._registry_loop(), name="registry"))
            self.retirer = Retirer(self.registry, self.handler.cache, interval_s=max(1.0, cfg.heartbeat_s))
            self.tasks.append(asyncio.create_task(self.retirer.run(), name="retire"))
        else:
            self.pull_done.set()

    async def _prefetch_loop(self) -> None:
        """Popularity prefetch: the adapters this replica's traffic asks for most go back into RAM
        (and free device slots) before their next request."""
        while True:
            await asyncio.sleep(self.config.prefetch_interval_s)
            try:
                moved = await self.handler.cache.prefetch_popular(self.config.prefetch_top)
                if moved:
                    log.info("prefetched %d popular adapters: %s", len(moved), moved)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("popularity prefetch: %s", e)

    async def _fetch_merged(self, ctx: HandlerContext, source, trusted) -> Path:
        """Merged mode: fetch and verify the adapter before the engine is built."""
        aid = ctx.merged_adapter
        base_hash = await asyncio.to_thread(base_model_hash, ctx.model_dir)
        dest = ctx.disk_dir / "merged" / aid
        lar = ctx.disk_dir / "merged" / f"{aid}.lar"
        lar.parent.mkdir(parents=True, exist_ok=True)
        if not await source.exists(aid):
            raise RuntimeError(f"merged adapter {aid} is not known to the registry/catalog")
        got = await source.fetch(aid, lar) or lar  # a local store hands back its own file, read in place
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        await asyncio.to_thread(extract_archive, got, dest, trusted, base_model_hash=base_hash,
                                max_rank=ctx.limits.rank_limit)
        lar.unlink(missing_ok=True)  # only our download, never the store's file
        return dest

    async def stop(self) -> None:
        self.ready = False
        if getattr(self, "retirer", None) is not None:
            await self.retirer.stop()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.handler.initialized:
            await self.handler.shutdown()
        elif self.store is not None:
            await self.store.close()
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await self.registry.aclose()

    # -- registry ---------------------------------------------------------------------------

    async def _join(self) -> None:
        await self.registry.join_replica(self.config.replica_id, self.config.url(), self.handler.base_model_hash,
                                         list(self.handler.models))
        self.joined = True
        log.info("joined the registry at %s as %s", self.config.registry_url, self.config.replica_id)

    async def _registry_loop(self) -> None:
        pull: asyncio.Task | None = None
        last_pull = 0.0
        backoff = self.config.heartbeat_s
        while True:
            try:
                if not self.joined:
                    await self._join()
                else:
                    await self.registry.heartbeat(self.config.replica_id, self.handler.state())
                backoff = self.config.heartbeat_s
                now = time.monotonic()
                if (pull is None or pull.done()) and (last_pull == 0.0 or now - last_pull >= self.config.placements_refresh_s):
                    last_pull = now
                    pull = asyncio.create_task(self._pull_owned(first=pull is None), name="pull-owned")
                    self.tasks = [t for t in self.tasks if not t.done()] + [pull]
            except RegistryError as e:
                if e.status == 404:
                    self.joined = False  # the registry forgot us (restart): join again
                log.warning("registry: %s", e)
                backoff = min(backoff * 2, 15.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("registry loop: %s", e)
                backoff = min(backoff * 2, 15.0)
            await asyncio.sleep(backoff)

    async def _pull_owned(self, first: bool = True) -> None:
        """Pull owned adapters to disk and RAM; on the first pull, pre-warm the first ones into device
        slots. Later pulls (placements change as replicas come and go) fetch only what is missing."""
        try:
            if not self.config.pull_owned or self.config.merged_adapter:
                return
            placed = await self.registry.placements_for_replica(self.config.replica_id)
            cache = self.handler.cache
            owned = list((placed or {}).get("adapters") or [])
            retirer = getattr(self, "retirer", None)
            if retirer is not None:  # a version a deploy retired is owned still, but not pulled back in
                owned = [a for a in owned if not retirer.is_retired(a)]
            if not first:
                owned = [a for a in owned if not cache.is_local(a)]
            n_warm = self.config.prewarm if self.config.prewarm is not None else self.config.slots
            n_warm = n_warm if first else 0
            sem = asyncio.Semaphore(2)
            left = []  # owned, but the disk tier is full: they stay in the store until asked for
            running = 0  # pulls under way (their bytes are not in the tiers yet)

            async def pull(aid: str, warm: bool):
                nonlocal running
                async with sem:
                    try:
                        if warm:
                            await cache.load(aid)
                        elif cache.has_room("disk", pending=running):  # else it evicts what was just pulled
                            to_ram = cache.has_room("ram", pending=running)
                            running += 1
                            try:
                                await cache.prefetch(aid, to_ram=to_ram)
                            finally:
                                running -= 1
                        else:
                            left.append(aid)
                    except (AdapterLoadError, AdapterNotFoundError) as e:
                        log.warning("owned adapter %s not pulled: %s", aid, e)

            await asyncio.gather(*(pull(aid, i < n_warm) for i, aid in enumerate(owned)))
            if owned and (first or len(owned) > len(left)):  # a refresh that found nothing to do says nothing
                log.info("pulled %d owned adapters (%d pre-warmed)%s", len(owned) - len(left), min(n_warm, len(owned)),
                         f"; {len(left)} left in the store: the disk tier is full" if left else "")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("pulling owned adapters failed: %s", e)
        finally:
            self.pull_done.set()

    def check_replica(self, replica_id: str) -> None:
        if replica_id != self.config.replica_id:
            raise oai.OpenAIError(404, f"this is replica {self.config.replica_id}, not {replica_id}",
                                  code="replica_not_found")


def _on_cpu(cfg: ReplicaConfig) -> bool:
    """Whether the engine will run on the CPU (where the C kernels serve its decode steps)."""
    device = cfg.engine.device
    return str(device).startswith("cpu") if device else not torch.cuda.is_available()


def _service(request: Request) -> ReplicaService:
    svc: ReplicaService = request.app.state.replica
    if not svc.ready:  # starting, or draining: nothing is read
        raise not_ready()
    return svc


# ------------------------------------------------------------------------------ completions


class ClientDisconnected(Exception):
    """The client went away before its response was ready (answered 499; nobody reads it)."""


def _disconnected_handler(_: Request, exc: ClientDisconnected) -> Response:
    return Response(content=b"", status_code=499)


async def _or_disconnect(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    try:
        return await unless_disconnected(request.receive, coro)
    except ClientGone:
        raise ClientDisconnected() from None


async def _complete(request: Request, kind: str) -> Response | Stream:
    """The handler's steps: preprocess, admit (shed), inference, then postprocess (the whole answer)
    or stream (SSE). A stream waits for its admission (adapter load, engine refusal) up to one
    keep-alive interval, so that its errors (404, 422, 503: the router fails those over) keep their
    HTTP status; past that it is committed and keep-alives flow while it waits. A client that leaves
    cancels its request wherever it is (counted cancelled; answered 499)."""
    h = _service(request).handler
    # a client that leaves while its body is prepared or its grammar compiles stops that work (its
    # queued prep job and compile are dropped: handler.serving.prep, handler.grammar.pool)
    greq = await _or_disconnect(request, h.preprocess(
        kind, await request.body(), request.headers.get("x-lorafarm-tenant") or None,
        request.headers.get("x-lorafarm-model-name")))
    greq.tenant_weight = clamp_weight(request.headers.get("x-lorafarm-tenant-weight"))  # fair share (engine)
    greq.hold = holds.for_request(request.headers.get("x-request-id"))  # None unless a test farm marks it
    h.admit(greq)
    gen = h.inference(greq)
    try:
        if not greq.stream:
            body = await _or_disconnect(request, h.postprocess(greq, gen))
            return _json_response(200, body, _headers(greq))
        keepalive = h.context.limits.stream_keepalive_s
        await _or_disconnect(request, gen.admitted(keepalive if keepalive > 0 else None))
    except BaseException:
        gen.abandon()  # no-op once it ended or failed admission
        raise
    return Stream(h.stream(greq, gen), media_type="text/event-stream",
                  headers={**_headers(greq), "cache-control": "no-cache", "x-accel-buffering": "no"})


def _headers(greq: GenerationRequest) -> dict[str, str]:
    """What the answer's headers say about it: the adapter, the tier it was found in, its id."""
    return {"x-adapter-id": greq.adapter_id or greq.model, "x-adapter-tier": greq.tier,
            "x-request-id": greq.request_id}


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response | Stream:
    return await _complete(request, "chat")


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response | Stream:
    return await _complete(request, "completion")


@get("/v1/models")
async def list_models(request: Request) -> dict:
    svc = _service(request)
    h = svc.handler
    created = int(svc.started_at)
    data = [{"id": m, "object": "model", "created": created, "owned_by": "lorafarm", "root": m, "parent": None}
            for m in h.models]
    base = h.models[0] if h.models else None
    if not svc.config.merged_adapter:
        local = dict.fromkeys(h.cache.gpu_adapters() + h.cache.ram_adapters() + h.cache.disk_adapters())
        data += [{"id": a, "object": "model", "created": created, "owned_by": "lorafarm", "root": a,
                  "parent": base} for a in local]
    return {"object": "list", "data": data}


# ------------------------------------------------------------------------------ internal API


@post("/internal/replicas/{replica_id:str}/adapters/{adapter_id:str}/load", status_code=200)
async def load_adapter(request: Request, replica_id: str, adapter_id: str) -> Response:
    """Pre-warm into a device slot: 200 once mounted; 202 when it is still waiting (every slot of its
    pool busy with running requests) after the load timeout: the load goes on in the background."""
    svc = _service(request)
    svc.check_replica(replica_id)
    if svc.config.merged_adapter:
        raise oai.OpenAIError(409, "a merged-mode replica serves only its merged adapter", code="merged_mode")
    cache = svc.handler.cache
    t0 = time.perf_counter()
    previous = cache.tier_of(adapter_id)
    try:
        if not await cache.exists(adapter_id):
            raise oai.model_not_found(adapter_id)
        task = asyncio.ensure_future(cache.load(adapter_id))
        done, _ = await asyncio.wait({task}, timeout=svc.config.limits.load_timeout_s)
        if not done:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            return _json_response(202, {"adapter_id": adapter_id, "replica_id": replica_id, "previous_tier": previous,
                                        "tier": cache.tier_of(adapter_id), "pending": True})
        task.result()
    except AdapterNotFoundError:
        raise oai.model_not_found(adapter_id) from None
    except AdapterLoadError as e:
        raise load_error_to_openai(e) from None
    return _json_response(200, {"adapter_id": adapter_id, "replica_id": replica_id, "previous_tier": previous,
                                "tier": cache.tier_of(adapter_id), "pending": False,
                                "load_ms": round((time.perf_counter() - t0) * 1000, 3)})


@post("/internal/replicas/{replica_id:str}/adapters/{adapter_id:str}/unload", status_code=200)
async def unload_adapter(request: Request, replica_id: str, adapter_id: str, purge: bool = False) -> dict:
    """Drains the adapter's running requests first (new ones wait), then frees its slot and RAM
    (and its disk copy with `?purge=true`)."""
    svc = _service(request)
    svc.check_replica(replica_id)
    try:
        out = await svc.handler.cache.unload(adapter_id, purge_disk=purge)
    except AdapterNotFoundError:
        raise oai.model_not_found(adapter_id) from None
    return {**out, "replica_id": replica_id, "tier": svc.handler.cache.tier_of(adapter_id)}


@get("/internal/replicas/{replica_id:str}/state")
async def replica_state(request: Request, replica_id: str) -> dict:
    svc = _service(request)
    svc.check_replica(replica_id)
    return svc.handler.state().model_dump(mode="json")


@get("/internal/replicas/{replica_id:str}/cache")
async def cache_stats(request: Request, replica_id: str) -> dict:
    """Counters of the adapter cache (loads per tier, evictions, in-use evictions, waits)."""
    svc = _service(request)
    svc.check_replica(replica_id)
    return svc.handler.cache.stats()


@get("/health")
async def health(request: Request) -> Response:
    svc: ReplicaService = request.app.state.replica
    if not svc.ready:
        return _json_response(503, {"status": "starting", "replica_id": svc.config.replica_id})
    h = svc.handler
    return _json_response(200, {"status": "ok", "replica_id": svc.config.replica_id,
                                "base_model_hash": h.base_model_hash, "models": h.models,
                                "registry": svc.config.registry_url, "joined": svc.joined})


@get("/ready")
async def ready(request: Request) -> Response:
    """Readiness (Kubernetes): 200 once the base is loaded and the first pull of owned adapters (to disk
    and RAM, the first ones mounted) is done; 503 while starting or draining."""
    svc: ReplicaService = request.app.state.replica
    if not svc.ready or not svc.pull_done.is_set():
        status = "draining" if svc.handler.draining else "starting" if not svc.ready else "warming"
        return _json_response(503, {"status": status, "replica_id": svc.config.replica_id})
    return _json_response(200, {"status": "ready", "replica_id": svc.config.replica_id, "joined": svc.joined})


@post("/internal/drain", status_code=200)
async def drain(request: Request) -> Response:
    """preStop: stop taking requests (503 not_ready, so the router fails over and its health checks
    take this replica out); requests in flight finish. SIGTERM follows."""
    svc: ReplicaService = request.app.state.replica
    svc.ready = False
    svc.handler.draining = True  # its admission refuses the requests already past the front door
    return _json_response(200, {"status": "draining", "replica_id": svc.config.replica_id,
                                "waiting": svc.handler.waiting() if svc.handler.initialized else 0})


@get("/metrics")
async def metrics(request: Request) -> Response:
    svc: ReplicaService = request.app.state.replica
    if svc.ready:
        svc.handler.refresh_gauges()
    return Response(content=svc.metrics.render(), media_type=CONTENT_TYPE, status_code=200)


# ------------------------------------------------------------------------------ factory


def create_app(config: ReplicaConfig) -> Litestar:
    """The replica app. Its lifespan loads the model and starts everything; see the module doc."""
    service = ReplicaService(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    middleware = [access_log_middleware("replica")]
    if config.admin_token:
        token = config.admin_token
        middleware.append(lambda app: AdminAuthMiddleware(app, token))
    app = Litestar(
        route_handlers=[chat_completions, completions, list_models, load_adapter, unload_adapter, replica_state,
                        cache_stats, health, ready, drain, metrics],
        lifespan=[lifespan],
        middleware=middleware,
        exception_handlers={oai.OpenAIError: _openai_error_handler, HTTPException: _http_error_handler,
                            ClientDisconnected: _disconnected_handler, Exception: _server_error_handler},
        request_max_body_size=config.limits.max_body_bytes,
        openapi_config=openapi_config(
            "lorafarm replica", "One replica: OpenAI-compatible completions and the internal adapter API.",
            OPENAPI_BODIES, "the farm's admin token"),
        debug=False,
    )
    app.state.replica = service
    app.state.openapi_bodies = OPENAPI_BODIES
    return app


def run(config: ReplicaConfig, log_level: str = "info") -> None:
    """Serve with uvicorn until SIGINT/SIGTERM."""
    logging.basicConfig(level=os.environ.get("LORAFARM_LOG_LEVEL", log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_polling_loggers()
    app = create_app(config)
    app.state.replica.phases.add("imports", *since_process_start())  # interpreter, torch, the app's modules
    # uvicorn's own access log would print every 1 s state poll; lorafarm.access logs them at DEBUG.
    serve(app, config.host, config.port, log_level=log_level, access_log=False,
          timeout_graceful_shutdown=config.shutdown_grace_s)  # slow-client limits, as the router
