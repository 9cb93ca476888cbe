"""TEST DOUBLES for the router's own tests and its overhead benchmark: a stand-in registry and a
stand-in replica, small Litestar apps that speak the contracts of docs/contracts.md (the parts the
router calls). They are not the real registry/ or handler/ services; the end-to-end tests in
tests/e2e use those.

`serve(app)` runs any ASGI app under uvicorn on 127.0.0.1 (a free port) inside the running event
loop and yields a `Served` handle with `.url` and `.stop()` (a "kill": the port then refuses).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

ADMIN_TOKEN = "test-admin-token"


def base_hash(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def adapter_id(tenant: str, name: str) -> str:
    return "ad-" + hashlib.sha256(f"{tenant}\0{name}".encode()).hexdigest()[:20]


def _unauthorized(code: str = "invalid_admin_token") -> Response:
    body = {"error": {"message": "bad token", "type": "invalid_request_error", "param": None, "code": code}}
    return Response(content=json.dumps(body).encode(), status_code=401, media_type="application/json")


def _admin_ok(request: Request) -> bool:
    return request.headers.get("authorization", "") == f"Bearer {ADMIN_TOKEN}"


# -- stand-in registry --------------------------------------------------------------------------


@dataclass
class FakeRegistry:
    """Holds tenants/keys, aliases, adapters, base models and replicas; serves
    POST /internal/auth/verify, GET /internal/routing (ETag/304), POST /internal/stats, GET /health."""

    tenants: dict[str, dict] = field(default_factory=dict)  # api_key -> verify answer
    aliases: dict[str, dict] = field(default_factory=dict)
    adapters: dict[str, dict] = field(default_factory=dict)
    base_models: dict[str, str] = field(default_factory=dict)
    replicas: list[dict] = field(default_factory=list)
    version: int = 1
    stats: list[dict] = field(default_factory=list)
    verify_calls: int = 0
    routing_calls: int = 0
    down: bool = False  # answer 503 to everything

    def add_tenant(self, tenant_id: str, requests_per_s: float | None = None, tokens_per_s: float | None = None) -> str:
        key = f"lf-{tenant_id}-" + hashlib.sha256(tenant_id.encode()).hexdigest()[:16]
        self.tenants[key] = {
            "tenant_id": tenant_id, "key_id": f"k-{tenant_id}",
            "requests_per_s": requests_per_s, "tokens_per_s": tokens_per_s,
        }  # fmt: skip
        return key

    def add_adapter(self, tenant_id: str, name: str, base: str, alias: str | None = None, owners_k: int = 2) -> str:
        aid = adapter_id(tenant_id, name)
        self.adapters[aid] = {
            "tenant_id": tenant_id, "base_model_hash": base_hash(base), "owners_k": owners_k, "status": "active",
        }  # fmt: skip
        if alias:
            self.aliases[alias] = {"adapter_id": aid, "tenant_id": tenant_id}
        self.version += 1
        return aid

    def set_alias(self, alias: str, aid: str) -> None:
        self.aliases[alias] = {"adapter_id": aid, "tenant_id": self.adapters[aid]["tenant_id"]}
        self.version += 1

    def add_replica(self, replica_id: str, url: str, base: str, capacity_weight: float = 1.0) -> None:
        self.base_models.setdefault(base, base_hash(base))
        self.replicas = [r for r in self.replicas if r["replica_id"] != replica_id]
        self.replicas.append({
            "replica_id": replica_id, "url": url, "base_model_hash": base_hash(base), "models": [base],
            "capacity_weight": capacity_weight, "status": "up", "last_seen": "2026-01-01T00:00:00Z",
        })  # fmt: skip
        self.version += 1

    def remove_replica(self, replica_id: str) -> None:
        self.replicas = [r for r in self.replicas if r["replica_id"] != replica_id]
        self.version += 1

    def table(self) -> dict:
        return {
            "version": self.version, "aliases": self.aliases, "adapters": self.adapters,
            "base_models": self.base_models, "replicas": self.replicas, "rank_limit": 64,
        }  # fmt: skip

    def app(self) -> Litestar:
        reg = self

        @post("/internal/auth/verify", status_code=200)
        async def verify(request: Request) -> Response:
            if reg.down:
                return Response(content=b"{}", status_code=503, media_type="application/json")
            if not _admin_ok(request):
                return _unauthorized()
            reg.verify_calls += 1
            body = await request.json()
            tenant = reg.tenants.get(body.get("api_key", ""))
            if tenant is None:
                return _unauthorized("invalid_api_key")
            return Response(content=json.dumps(tenant).encode(), media_type="application/json")

        @get("/internal/routing")
        async def routing(request: Request) -> Response:
            if reg.down:
                return Response(content=b"{}", status_code=503, media_type="application/json")
            if not _admin_ok(request):
                return _unauthorized()
            reg.routing_calls += 1
            etag = f'"v{reg.version}"'
            if request.headers.get("if-none-match") == etag:
                return Response(content=b"", status_code=304, headers={"etag": etag})
            return Response(content=json.dumps(reg.table()).encode(), media_type="application/json",
                            headers={"etag": etag})  # fmt: skip

        @post("/internal/stats", status_code=200)
        async def stats(request: Request) -> Response:
            if not _admin_ok(request):
                return _unauthorized()
            reg.stats.append(await request.json())
            return Response(content=b"", status_code=204)

        @get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        return Litestar([verify, routing, stats, health], openapi_config=None, logging_config=None)


# -- stand-in replica ---------------------------------------------------------------------------


@dataclass
class FakeReplica:
    """Streams `chunks` words per answer; holds adapters in an LRU "GPU" of `gpu_slots` (a request
    for an adapter not on the GPU loads it there: tier ram if it was in RAM, else disk).
    Behaviour switches: state_fails, health_fails, fail_before_first_byte (int: that many
    requests), fail_after_chunks (break the stream after N chunks), first_token_delay, chunk_delay."""

    replica_id: str
    base: str = "dev-a"
    gpu_slots: int = 4
    chunks: int = 4
    first_token_delay: float = 0.0
    chunk_delay: float = 0.0
    state_fails: bool = False
    state_delay: float = 0.0  # a slow /state (seconds)
    health_fails: bool = False
    fail_before_first_byte: int = 0
    fail_after_chunks: int | None = None
    keepalive_interval: float | None = None  # while first_token_delay runs, send `: keep-alive` comments
    shed: bool = False  # answer 503 + Retry-After before accepting (an overloaded replica)
    chunk_gate: asyncio.Semaphore | None = None  # each word after the first waits for a release (the client's)
    gpu: OrderedDict = field(default_factory=OrderedDict)
    ram: set = field(default_factory=set)
    requests: list[dict] = field(default_factory=list)
    tokens_in_flight: int = 0
    running: int = 0
    state_calls: int = 0

    def warm(self, *adapter_ids: str) -> None:
        for a in adapter_ids:
            self._to_gpu(a)

    def _to_gpu(self, aid: str) -> None:
        self.gpu[aid] = True
        self.gpu.move_to_end(aid)
        while len(self.gpu) > self.gpu_slots:
            old, _ = self.gpu.popitem(last=False)
            self.ram.add(old)
        self.ram.discard(aid)

    def state(self) -> dict:
        return {
            "replica_id": self.replica_id, "base_model_hash": base_hash(self.base), "models": [self.base],
            "gpu_adapters": list(self.gpu), "ram_adapters": sorted(self.ram), "queue_depth": 0,
            "running": self.running, "tokens_in_flight": self.tokens_in_flight,
        }  # fmt: skip

    def app(self) -> Litestar:
        rep = self

        def err(status: int, message: str, code: str | None = None, type_: str = "invalid_request_error") -> Response:
            body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
            return Response(content=json.dumps(body).encode(), status_code=status, media_type="application/json")

        async def completion(request: Request, chat: bool) -> Response:
            if not _admin_ok(request):
                return _unauthorized()
            body = await request.json()
            model = body.get("model")
            if model != rep.base and not str(model).startswith("ad-"):
                return err(404, f"The model `{model}` does not exist.", "model_not_found")
            if model == rep.base:
                tier = None
            elif model in rep.gpu:
                tier = "gpu"
            elif model in rep.ram:
                tier = "ram"
            else:
                tier = "disk"
            if tier:
                rep._to_gpu(model)
            rep.requests.append({"model": model, "tier": tier, "at": time.monotonic(), "stream": body.get("stream"),
                                 "echo": request.headers.get("x-lorafarm-model-name"),
                                 "tenant": request.headers.get("x-lorafarm-tenant"),
                                 "weight": request.headers.get("x-lorafarm-tenant-weight")})
            max_tokens = int(body.get("max_tokens") or 16)
            headers = {"x-replica": rep.replica_id}
            if tier:
                headers.update({"x-adapter-id": model, "x-adapter-tier": tier})
            words = [f"w{i}" for i in range(rep.chunks)]
            text = f"{rep.replica_id}:{model} " + " ".join(words)
            created = int(time.time())
            obj = "chat.completion" if chat else "text_completion"
            usage = {"prompt_tokens": 5, "completion_tokens": rep.chunks, "total_tokens": 5 + rep.chunks}
            if rep.shed:
                body = {"error": {"message": "the replica is overloaded (test)", "type": "server_error",
                                  "param": None, "code": "overloaded"}}
                return Response(content=json.dumps(body).encode(), status_code=503, media_type="application/json",
                                headers={"Retry-After": "2"})
            fail_now = rep.fail_before_first_byte > 0
            if fail_now:
                rep.fail_before_first_byte -= 1

            if not body.get("stream"):
                if fail_now:
                    return err(503, "replica failing (test)", "overloaded", "server_error")
                await asyncio.sleep(rep.first_token_delay + rep.chunk_delay * rep.chunks)
                choice = (
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    if chat
                    else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
                )
                out = {"id": "cmpl-1", "object": obj, "created": created, "model": model,
                       "choices": [choice], "usage": usage}  # fmt: skip
                return Response(content=json.dumps(out).encode(), media_type="application/json", headers=headers)

            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(content: str | None, finish: str | None = None) -> bytes:
                if chat:
                    delta = {"content": content} if content is not None else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": content or "", "finish_reason": finish, "logprobs": None}
                c = {"id": "cmpl-1", "object": chunk_obj, "created": created, "model": model, "choices": [choice]}
                return f"data: {json.dumps(c)}\n\n".encode()

            async def gen() -> AsyncIterator[bytes]:
                rep.running += 1
                rep.tokens_in_flight += max_tokens
                try:
                    if fail_now:
                        raise ConnectionAbortedError("replica dies before the first byte (test)")
                    if chat:  # like the real replica: an empty role chunk at once, tokens later
                        role = {"id": "cmpl-1", "object": chunk_obj, "created": created, "model": model,
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]}  # fmt: skip
                        yield f"data: {json.dumps(role)}\n\n".encode()
                    if rep.keepalive_interval:
                        waited = 0.0
                        while waited < rep.first_token_delay:
                            step = min(rep.keepalive_interval, rep.first_token_delay - waited)
                            await asyncio.sleep(step)
                            waited += step
                            yield b": keep-alive\n\n"
                    else:
                        await asyncio.sleep(rep.first_token_delay)
                    pieces = [f"{rep.replica_id}:{model} "] + [w + " " for w in words]
                    for i, p in enumerate(pieces):
                        if rep.fail_after_chunks is not None and i >= rep.fail_after_chunks:
                            raise ConnectionAbortedError("replica dies mid-stream (test)")
                        if i and rep.chunk_delay:
                            await asyncio.sleep(rep.chunk_delay)
                        if i > 1 and rep.chunk_gate is not None:
                            await rep.chunk_gate.acquire()
                        yield chunk(p)
                    yield chunk(None, "stop")
                    if include_usage:
                        u = {"id": "cmpl-1", "object": chunk_obj, "created": created, "model": model,
                             "choices": [], "usage": usage}  # fmt: skip
                        yield f"data: {json.dumps(u)}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                finally:
                    rep.running -= 1
                    rep.tokens_in_flight -= max_tokens

            return Stream(content=gen(), media_type="text/event-stream", headers=headers)

        @post("/v1/chat/completions", status_code=200)
        async def chat_completions(request: Request) -> Response:
            return await completion(request, True)

        @post("/v1/completions", status_code=200)
        async def completions(request: Request) -> Response:
            return await completion(request, False)

        @get("/internal/replicas/{replica_id:str}/state")
        async def state(request: Request, replica_id: str) -> Response:
            rep.state_calls += 1
            if rep.state_delay:
                await asyncio.sleep(rep.state_delay)
            if not _admin_ok(request):
                return _unauthorized()
            if rep.state_fails or replica_id != rep.replica_id:
                return err(503, "state unavailable (test)", type_="server_error")
            return Response(content=json.dumps(rep.state()).encode(), media_type="application/json")

        @get("/health")
        async def health() -> Response:
            if rep.health_fails:
                return err(503, "unhealthy (test)", type_="server_error")
            return Response(content=b'{"status":"ok"}', media_type="application/json")

        return Litestar([chat_completions, completions, state, health], openapi_config=None, logging_config=None)


# -- running apps -------------------------------------------------------------------------------


class Served:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task, port: int):
        self.server = server
        self.task = task
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self, kill: bool = False) -> None:
        """Stop listening and close connections. `kill`: also skip the app's lifespan shutdown
        (a killed process, as far as clients see)."""
        if self.task.done():
            return
        self.server.should_exit = True
        self.server.force_exit = kill
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self.task), timeout=5)
        if not self.task.done():
            self.task.cancel()


async def start_server(app, port: int = 0) -> Served:
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then (no 40 ms Nagle stalls)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="critical", access_log=False, lifespan="on", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # leave the test process's signal handlers alone
    task = asyncio.create_task(server.serve(sockets=[sock]))
    from tests.waiting import wait_until  # here, not on top: benchmarks/ import this module too

    await wait_until(lambda: server.started or task.done(), 60, interval=0.01,
                     what=f"a server started on port {port}")
    if task.done():
        task.result()
    if not server.started:
        raise RuntimeError("server did not start")
    return Served(server, task, port)


@contextlib.asynccontextmanager
async def serve(app, port: int = 0) -> AsyncIterator[Served]:
    served = await start_server(app, port)
    try:
        yield served
    finally:
        await served.stop()


# -- a replica that dies (raw sockets) ----------------------------------------------------------


class DyingReplica:
    """A stand-in replica on raw asyncio sockets (so it can die the way a process does): it answers
    /health, /internal/replicas/{id}/state and non-streamed (or streamed) completions. A completion
    whose body contains `poison` (or any completion while the shared `kills` budget {"n": k} is
    above 0, which it then decrements) kills it: every
    connection is reset (RST) and the listening socket closed, so the port refuses from then on, as
    after a segfault."""

    def __init__(self, replica_id: str, base: str = "dev-a", poison: bytes = b"POISON"):
        self.replica_id = replica_id
        self.base = base
        self.poison = poison
        self.kills: dict | None = None
        self.die_holding = 0  # > 0: hold completions, and die once this many are held (all in flight)
        self.hits: list[bytes] = []  # completion bodies received
        self.dead = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> DyingReplica:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def die(self) -> None:
        if self.dead.is_set():
            return
        self.dead.set()
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            _reset(w)

    async def stop(self) -> None:
        self.die()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while not self.dead.is_set():
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(hdrs.get("content-length") or 0))
                if self.die_holding and method == "POST" and path.startswith("/v1/"):
                    self.hits.append(body)
                    if len(self.hits) >= self.die_holding:
                        self.die()
                    await self.dead.wait()
                    return
                status, ctype, payload = self._answer(method, path, body)
                if status == 0:  # died
                    return
                writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, ctype.encode(), len(payload), payload))
                await writer.drain()
        finally:
            self._writers.discard(writer)

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        if method == "GET" and path == "/health":
            return 200, "application/json", b'{"status":"ok"}'
        if method == "GET" and path.startswith("/internal/replicas/"):
            state = {"replica_id": self.replica_id, "base_model_hash": base_hash(self.base), "models": [self.base],
                     "gpu_adapters": [], "ram_adapters": [], "queue_depth": 0, "running": 0, "tokens_in_flight": 0}
            return 200, "application/json", json.dumps(state).encode()
        if method == "POST" and path.startswith("/v1/"):
            self.hits.append(body)
            killed = self.kills is not None and self.kills.get("n", 0) > 0
            if killed:
                self.kills["n"] -= 1
            if killed or self.poison in body:
                self.die()
                return 0, "", b""
            req = json.loads(body)
            text = f"{self.replica_id}:{req.get('model')}"
            if req.get("stream"):
                c = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": req.get("model"),
                     "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]}
                return 200, "text/event-stream", f"data: {json.dumps(c)}\n\ndata: [DONE]\n\n".encode()
            out = {"id": "c", "object": "chat.completion", "created": 0, "model": req.get("model"),
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            return 200, "application/json", json.dumps(out).encode()
        return 404, "application/json", b'{"error":{"message":"no","type":"invalid_request_error"}}'


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as the kernel does for a killed process with unread data."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError, ValueError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class ResettingServer:
    """A listening port whose every connection is reset (RST) the moment it is accepted, from its own
    thread (as a dying process does, independently of the client's event loop): the client's connect
    succeeds, then the connection breaks. Counts the connections it reset."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.resets = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            time.sleep(0)  # let the client's thread run on (a dying process does not hold its GIL)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.resets += 1

    async def stop(self, kill: bool = False) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
