"""The embedding worker (`lorafarm replica --task embed --base DIR`): a Litestar app serving one
encoder (`handler.embed.model`) with the replica's contract, so the router and registry treat it like any
replica: `POST /v1/embeddings`, `GET /v1/models`, `GET /internal/replicas/{id}/state` (a
`ReplicaState` with `task: "embed"`, its model, and the inputs/tokens in flight), `GET /health`,
`GET /metrics`; it joins the registry and heartbeats when `--registry` is given.

Chat and completion requests are answered 400 (`model_not_chat`): this worker only embeds.

Fairness: the router names the tenant of each request (`x-lorafarm-tenant`); the batcher interleaves
tenants (deficit round robin by tokens) and splits a large request into chunks (`handler.embed.model`).
Tokenising the inputs and encoding the JSON answer (2,048 vectors are megabytes) run in a worker
thread, not on the event loop, so a huge request does not stall the others' answers either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from archives.basehash import base_model_hash
from lorafarm import openai_schemas as oai
from handler.serving.app import (
    AdminAuthMiddleware,
    _http_error_handler,
    _json_response,
    _openai_error_handler,
    _server_error_handler,
)
from handler.embed.model import EmbeddingBatcher, EmbeddingInputError, Encoder, base64_float32
from lorafarm.embeddings import EmbeddingsRequestError, parse_embeddings
from lorafarm.registry_client import RegistryClient, RegistryError
from lorafarm.schemas import ReplicaState

log = logging.getLogger("lorafarm.replica.embed")


@dataclass
class EmbedConfig:
    base_dir: Path
    replica_id: str = "e0"
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8300
    advertise_url: str | None = None
    registry_url: str | None = None
    admin_token: str | None = None
    device: str | None = None
    max_batch: int = 32
    max_body_bytes: int = 8 * 1024 * 1024
    heartbeat_s: float = 1.0

    def resolved_model_name(self) -> str:
        return self.model_name or Path(self.base_dir).resolve().name

    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


class EmbedMetrics:
    def __init__(self, replica_id: str, model: str):
        self.registry = CollectorRegistry()
        labels = {"replica_id": replica_id, "model_name": model}
        self.requests = Counter("lorafarm_embedding_requests", "Embedding requests by status", ["status"],
                                registry=self.registry).labels
        self.inputs = Counter("lorafarm_embedding_inputs", "Inputs embedded", registry=self.registry)
        self.tokens = Counter("lorafarm_embedding_prompt_tokens", "Tokens embedded", registry=self.registry)
        self.batch = Histogram("lorafarm_embedding_batch_size", "Inputs per encoder batch",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.batch_seconds = Histogram("lorafarm_embedding_batch_seconds", "Encoder time per batch",
                                       registry=self.registry)
        self.labels = labels

    def on_batch(self, n: int, seconds: float) -> None:
        self.batch.observe(n)
        self.batch_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EmbedService:
    def __init__(self, config: EmbedConfig):
        self.config = config
        self.model_name = config.resolved_model_name()
        self.metrics = EmbedMetrics(config.replica_id, self.model_name)
        self.encoder: Encoder | None = None
        self.batcher: EmbeddingBatcher | None = None
        self.base_model_hash = ""
        self.registry = None
        self.joined = False
        self.ready = False
        self.tasks: list[asyncio.Task] = []
        self.started_at = time.time()

    async def start(self) -> None:
        cfg = self.config
        self.encoder = await asyncio.to_thread(Encoder, cfg.base_dir, cfg.device)
        self.base_model_hash = await asyncio.to_thread(base_model_hash, Path(cfg.base_dir))
        self.batcher = EmbeddingBatcher(self.encoder, max_batch=cfg.max_batch, on_batch=self.metrics.on_batch)
        self.batcher.start()
        self.ready = True
        log.info("embedding model %s ready (dimension %d, context %d tokens, pooling %s%s)", self.model_name,
                 self.encoder.dimension, self.encoder.max_tokens, "+".join(self.encoder.layout.pooling),
                 ", normalized" if self.encoder.layout.normalize else "")
        if cfg.registry_url:
            self.registry = RegistryClient(cfg.registry_url, cfg.admin_token)
            self.tasks.append(asyncio.create_task(self._registry_loop(), name="registry"))

    async def stop(self) -> None:
        self.ready = False
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.batcher is not None:
            await self.batcher.stop()
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await self.registry.aclose()

    def state(self) -> ReplicaState:
        b = self.batcher
        return ReplicaState(replica_id=self.config.replica_id, base_model_hash=self.base_model_hash,
                            models=[self.model_name], task="embed",
                            running=b.running if b else 0, tokens_in_flight=b.in_flight_tokens if b else 0)

    async def _registry_loop(self) -> None:
        backoff = self.config.heartbeat_s
        while True:
            try:
                if not self.joined:
                    await self.registry.join_replica(self.config.replica_id, self.config.url(),
                                                     self.base_model_hash, [self.model_name])
                    self.joined = True
                    log.info("joined the registry at %s as %s", self.config.registry_url, self.config.replica_id)
                else:
                    await self.registry.heartbeat(self.config.replica_id, self.state())
                backoff = self.config.heartbeat_s
            except RegistryError as e:
                if e.status == 404:
                    self.joined = False
                log.warning("registry: %s", e)
                backoff = min(backoff * 2, 15.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("registry loop: %s", e)
                backoff = min(backoff * 2, 15.0)
            await asyncio.sleep(backoff)

    async def embeddings(self, raw: bytes, tenant: str | None = None) -> bytes:
        """The JSON answer's bytes (built off the event loop)."""
        # a big body (2,048 inputs are a megabyte) is parsed and checked in a worker thread
        req = await asyncio.to_thread(_parse, raw) if len(raw) > _INLINE_BODY_BYTES else _parse(raw)
        if req.model != self.model_name:
            raise oai.model_not_found(req.model)
        enc = self.encoder
        assert enc is not None and self.batcher is not None
        if req.dimensions is not None and req.dimensions > enc.dimension:
            raise oai.bad_request(f"'dimensions' must be at most {enc.dimension} for model {self.model_name}",
                                  param="dimensions")
        try:
            ids = await asyncio.to_thread(_token_ids, enc, req.texts, req.token_ids)
        except EmbeddingInputError as e:
            raise oai.bad_request(str(e), param=e.param, code=e.code) from None
        emb = enc.finish(await self.batcher.embed(ids, tenant), req.dimensions)
        tokens = sum(len(r) for r in ids)
        self.metrics.inputs.inc(len(ids))
        self.metrics.tokens.inc(tokens)
        return await asyncio.to_thread(_answer, emb, req.encoding_format, self.model_name, tokens)


_INLINE_BODY_BYTES = 16 * 1024
_ANSWER_SLICE = 32  # vectors per json.dumps call: the GIL is free between calls, not during one


def _parse(raw: bytes):
    import json

    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        raise oai.bad_request("The request body is not valid JSON.") from None
    try:
        return parse_embeddings(body)
    except EmbeddingsRequestError as e:
        raise oai.bad_request(e.message, param=e.param, code=e.code) from None


def _token_ids(enc: Encoder, texts, token_ids) -> list[list[int]]:
    ids = enc.tokenize(texts) if texts is not None else token_ids
    enc.check_ids(ids)
    return ids


def _answer(emb, encoding_format: str, model: str, tokens: int) -> bytes:
    """The answer's JSON, encoded a slice of vectors at a time: one json.dumps of 2,048 vectors holds
    the GIL for its whole run (the event loop, in another thread, would stall that long)."""
    import json

    parts = []
    for start in range(0, len(emb), _ANSWER_SLICE):
        rows = emb[start:start + _ANSWER_SLICE]
        if encoding_format == "base64":
            data = [{"object": "embedding", "index": start + i, "embedding": base64_float32(v)}
                    for i, v in enumerate(rows)]
        else:
            data = [{"object": "embedding", "index": start + i, "embedding": v}
                    for i, v in enumerate(rows.tolist())]
        parts.append(json.dumps(data, separators=(",", ":"))[1:-1])
    tail = json.dumps({"model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                      separators=(",", ":"))[1:]
    return ('{"object":"list","data":[' + ",".join(parts) + "]," + tail).encode()


def _svc(request: Request) -> EmbedService:
    svc: EmbedService = request.app.state.embed
    if not svc.ready:
        raise oai.OpenAIError(503, "The embedding worker is starting.", type="server_error", code="not_ready",
                              headers={"Retry-After": "1"})
    return svc


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request) -> Response:
    svc = _svc(request)
    try:
        out = await svc.embeddings(await request.body(), request.headers.get("x-lorafarm-tenant") or None)
    except oai.OpenAIError as e:
        svc.metrics.requests(str(e.status)).inc()
        raise
    svc.metrics.requests("200").inc()
    return Response(content=out, status_code=200, media_type="application/json")


def _not_chat(request: Request) -> Response:
    svc = _svc(request)
    raise oai.bad_request(f"{svc.model_name} is an embedding model: use /v1/embeddings", param="model",
                          code="model_not_chat")


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    return _not_chat(request)


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    return _not_chat(request)


@get("/v1/models")
async def list_models(request: Request) -> dict:
    svc = _svc(request)
    return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": int(svc.started_at),
                                        "owned_by": "lorafarm", "root": svc.model_name, "parent": None}]}


@get("/internal/replicas/{replica_id:str}/state")
async def replica_state(request: Request, replica_id: str) -> dict:
    svc = _svc(request)
    if replica_id != svc.config.replica_id:
        raise oai.OpenAIError(404, f"this is replica {svc.config.replica_id}, not {replica_id}",
                              code="replica_not_found")
    return svc.state().model_dump(mode="json")


@get("/health")
async def health(request: Request) -> Response:
    svc: EmbedService = request.app.state.embed
    if not svc.ready:
        return _json_response(503, {"status": "starting", "replica_id": svc.config.replica_id})
    return _json_response(200, {"status": "ok", "replica_id": svc.config.replica_id, "task": "embed",
                                "base_model_hash": svc.base_model_hash, "models": [svc.model_name],
                                "registry": svc.config.registry_url, "joined": svc.joined})


@get("/metrics")
async def metrics(request: Request) -> Response:
    svc: EmbedService = request.app.state.embed
    return Response(content=svc.metrics.render(), media_type=CONTENT_TYPE_LATEST, status_code=200)


def create_embed_app(config: EmbedConfig) -> Litestar:
    service = EmbedService(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    middleware = []
    if config.admin_token:
        token = config.admin_token
        middleware.append(lambda app: AdminAuthMiddleware(app, token))
    app = Litestar(
        route_handlers=[embeddings, chat_completions, completions, list_models, replica_state, health, metrics],
        lifespan=[lifespan],
        middleware=middleware,
        exception_handlers={oai.OpenAIError: _openai_error_handler, HTTPException: _http_error_handler,
                            Exception: _server_error_handler},
        request_max_body_size=config.max_body_bytes,
        openapi_config=None,
        debug=False,
    )
    app.state.embed = service
    return app


def run(config: EmbedConfig, log_level: str = "info") -> None:
    import uvicorn

    logging.basicConfig(level=os.environ.get("LORAFARM_LOG_LEVEL", log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_embed_app(config), host=config.host, port=config.port, log_level=log_level,
                timeout_graceful_shutdown=10)
