"""Forwarding to replicas with httpx: failover before the first byte, unbuffered SSE after it.

`Proxy.open()` tries the ranked replicas in order until one gives a usable first byte:
- a refused/reset connection, a timeout, or a 5xx/429 answer before any body byte is a failover:
  the next replica is tried (up to max_attempts), and connection failures count against the
  replica's health;
- a 2xx or 4xx answer is committed: its first body chunk is already in hand, so a replica that
  dies between the headers and the first byte is also failed over.
For a non-streamed request the whole body is read before anything reaches the client, so any
failure there is still "before the first byte".

A replica that *dies* with the request in flight (the connection breaks after the request was sent
and the replica's /health no longer answers) is not an ordinary failover: the request goes to at
most `death_retries` more replicas, and a body in flight when two distinct replicas died, that has
not completed anywhere since, is refused (router/poison.py).
A replica that was already down (connection refused: nothing was sent) fails over as before.

Liveness, not a stopwatch: a stream's `read_timeout` is the longest *silence* between two chunks
(the replica sends `: keep-alive` comments while a request waits for its adapter, the queue or
prefill; they are passed on, OpenAI clients ignore them). A non-streamed answer is waited for as
long as its replica stays in routing (state polls and health checks; `_watch`), up to the request's
deadline (`x-request-timeout`, else `non_stream_timeout`); the deadline ends it with a 504, never a
failover.

`relay()` then passes the SSE stream through event by event as the bytes arrive (it only holds
back an incomplete event, so the client never sees half an event); if the replica fails
mid-stream, the client gets an OpenAI error event and `data: [DONE]`, never silence or a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import httpcore
import httpx

from router.poison import PoisonGuard
from router.routing import RankedReplica

log = logging.getLogger("lorafarm.router.proxy")

_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "content-length", "content-encoding", "date", "server",
}  # fmt: skip


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    body = json.dumps(error_body(message, "server_error", code), separators=(",", ":"))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class _ClosedSafeStream(httpcore.AsyncNetworkStream):
    """httpcore's anyio stream, except that asking a connection whose transport is already closed
    for its socket says "readable" (the pool then drops it as expired) instead of raising. Under
    uvloop a transport closed by a peer reset reports no socket, and anyio's socket attributes then
    raise `AttributeError: 'NoneType' object has no attribute 'getpeername'` (or ValueError for a
    closed descriptor) from the pool's expiry check, inside `send()` of an unrelated request: the
    router answered 500 right after a replica died (issue 26)."""

    def __init__(self, inner: httpcore.AsyncNetworkStream):
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _ClosedSafeStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str):
        try:
            return self._inner.get_extra_info(info)
        except (AttributeError, ValueError, OSError):
            return True if info == "is_readable" else None


class ClosedSafeBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        from httpcore._backends.auto import AutoBackend

        self._inner = AutoBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _ClosedSafeStream(await self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _ClosedSafeStream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# An idle upstream connection is dropped here after this long, well before a replica's keep-alive
# timeout (5 s, lorafarm.serving.ClientLimits) closes it: with both at 5 s the router could send a
# request on a connection the replica was closing, fail it before the first byte, and with one replica
# answer 503 (seen once in a bench-peers run, on a request sent as the farm was resumed from a pause).
UPSTREAM_KEEPALIVE_S = 2.0

# Every request in flight on a replica that dies notices it within a health probe of the others:
# deaths of one replica noticed within this many seconds of the first are one death (the refusal's
# message counts them; poison itself counts distinct replicas: router/poison.py).
DEATH_EVENT_S = 5.0
STARTING_RETRY_AFTER_S = 2  # Retry-After of the 503 while every replica tried is still starting


def make_http_client(max_connections: int, timeout: httpx.Timeout) -> httpx.AsyncClient:
    """The router's upstream client: a pool whose connections survive a peer reset (see
    `_ClosedSafeStream`) and are never reused once a replica may be closing them (UPSTREAM_KEEPALIVE_S)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                          keepalive_expiry=UPSTREAM_KEEPALIVE_S)
    transport = httpx.AsyncHTTPTransport(limits=limits)
    pool = getattr(transport, "_pool", None)
    if pool is not None and hasattr(pool, "_network_backend"):
        pool._network_backend = ClosedSafeBackend()
    return httpx.AsyncClient(transport=transport, timeout=timeout)


@dataclass
class Opened:
    """A replica that answered: status, headers and the first body bytes are in hand."""

    ranked: RankedReplica
    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes]
    attempts: int
    tried: list[str]
    first_byte_at: float
    streaming: bool  # text/event-stream
    fingerprint: str | None = None  # the poison fingerprint of the body (router/poison.py)
    deadline: float | None = None  # loop time when the whole request must be done (None: no deadline)
    request_id: str = ""
    tenant_id: str = ""

    @property
    def status_code(self) -> int:
        return self.response.status_code

    def passthrough_headers(self) -> dict[str, str]:
        return {k: v for k, v in self.response.headers.items() if k.lower() not in _HOP_BY_HOP}

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.response.aclose()


@dataclass
class Failed:
    """No replica gave a usable answer."""

    status_code: int
    body: bytes
    headers: dict[str, str]
    attempts: int
    tried: list[str] = field(default_factory=list)
    code: str | None = None  # the router's own verdict: poison_request, replica_died, request_timeout
    deaths: int = 0  # replicas that died with this request in flight


@dataclass
class UsageScanner:
    """Watches the events going by: the usage chunk and how many content chunks passed."""

    usage: dict | None = None
    content_events: int = 0
    first_token_at: float | None = None  # perf_counter when the first non-empty token passed
    finish_reasons: dict[str, int] = field(default_factory=dict)  # finish_reason -> choices (per-version metrics)

    def _finish(self, payload: bytes) -> None:
        if b'"finish_reason"' in payload:
            for m in _FINISH_REASON.finditer(payload):
                reason = m.group(1).decode()
                self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def feed_events(self, data: bytes) -> None:
        if b"data:" not in data:
            return
        for line in data.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            if self.first_token_at is None and _has_token(payload):
                self.first_token_at = time.perf_counter()
            self._finish(payload)
            if b'"usage"' in payload:
                try:
                    obj = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    self.usage = obj["usage"]
                if isinstance(obj, dict) and obj.get("choices"):
                    self.content_events += 1
            elif b'"choices"' in payload:
                self.content_events += 1

    def feed_json(self, body: bytes) -> None:
        self._finish(body)
        try:
            obj = json.loads(body)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]


_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]{1,32})"')


def _has_token(payload: bytes) -> bool:
    """Does this chunk carry generated text or a tool call (not just the role, an empty delta or usage)?"""
    if b'"content"' not in payload and b'"text"' not in payload and b'"tool_calls"' not in payload:
        return False
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    choices = obj.get("choices") if isinstance(obj, dict) else None
    for choice in choices or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
        if choice.get("text"):
            return True
    return False


def _event_boundary(buf: bytes) -> int:
    """Index just past the last complete SSE event in `buf` (0 if none)."""
    a = buf.rfind(b"\n\n")
    b = buf.rfind(b"\r\n\r\n")
    return max(a + 2 if a >= 0 else 0, b + 4 if b >= 0 else 0)


class Proxy:
    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        admin_token: str | None,
        max_attempts: int = 3,
        connect_timeout: float = 2.0,
        first_byte_timeout: float = 10.0,
        read_timeout: float = 10.0,
        non_stream_timeout: float = 600.0,
        health_timeout: float = 1.5,
        death_retries: int = 1,
        guard: PoisonGuard | None = None,
        is_responsive: Callable[[str], bool] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        on_success: Callable[[str], None] | None = None,
        on_failover: Callable[[str], None] | None = None,
        on_death: Callable[[str, str], None] | None = None,
        upstream_headers: Callable[[str, dict[str, str]], dict[str, str]] | None = None,
        probe_alive: Callable[[RankedReplica], Awaitable[bool]] | None = None,
    ):
        self.http = http
        self.admin_token = admin_token
        self.max_attempts = max_attempts
        # streams: read_timeout is the longest silence between two chunks (keep-alives count); a
        # non-streamed answer comes whole, after its generation
        self.timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=30.0, pool=connect_timeout)
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.read_timeout = read_timeout
        self.non_stream_timeout = non_stream_timeout
        self.health_timeout = health_timeout
        self.death_retries = death_retries
        self.guard = guard if guard is not None else PoisonGuard()
        self.is_responsive = is_responsive or (lambda rid: True)
        self.on_failure = on_failure or (lambda rid, why: None)
        self.on_success = on_success or (lambda rid: None)
        self.on_failover = on_failover or (lambda reason: None)
        self.on_death = on_death or (lambda rid, phase: None)
        # per-upstream headers (a foreign worker gets its own key, never the admin token)
        self.upstream_headers = upstream_headers or (lambda replica_id, h: h)
        self.probe_alive = probe_alive or self._probe_health
        self._death_checks: set[asyncio.Task] = set()
        self._death_events: dict[str, tuple[int, float]] = {}  # replica -> (its deaths, when the last began)

    def _headers(self, request_id: str, tenant_id: str) -> dict[str, str]:
        h = {"content-type": "application/json", "x-request-id": request_id, "x-lorafarm-tenant": tenant_id}
        if self.admin_token:
            h["authorization"] = f"Bearer {self.admin_token}"
        return h

    async def _probe_health(self, cand: RankedReplica) -> bool:
        """Is the replica's process still there? Any HTTP answer from /health says yes."""
        try:
            r = await self.http.get(f"{cand.replica.url}/health",
                                    timeout=httpx.Timeout(self.health_timeout, connect=self.connect_timeout))
            await r.aclose()
            return True
        except (httpx.HTTPError, OSError):
            return False

    async def _died(self, cand: RankedReplica, e: BaseException) -> bool:
        """A broken connection after the request was sent, and the replica no longer answers."""
        if isinstance(e, TimeoutError | httpx.TimeoutException):
            return False  # slow or frozen, not dead
        if not isinstance(e, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError | OSError):
            return False
        if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout | ConnectionRefusedError):
            return False
        with anyio.CancelScope(shield=True):
            return not await self.probe_alive(cand)

    def _record_death(self, replica_id: str, phase: str, fp: str | None) -> int:
        """A replica died with a request in flight: health, metrics, and one more death of the body
        (returns the deaths now counted for it; 0 without a fingerprint)."""
        self.on_failure(replica_id, "died")
        self.on_death(replica_id, phase)
        death = self._death_event(replica_id)
        return self.guard.record_death(fp, replica_id, death) if fp else 0

    def _death_event(self, replica_id: str) -> tuple[str, int]:
        """Names one death of a replica, the same for every request that was in flight on it: the
        deaths noticed within DEATH_EVENT_S of the first are that one (a restarted replica that dies
        again later is a new death)."""
        now = time.monotonic()
        n, began = self._death_events.get(replica_id, (0, float("-inf")))
        if now - began > DEATH_EVENT_S:
            n, began = n + 1, now
            self._death_events[replica_id] = (n, began)
        return replica_id, n

    def completed(self, fp: str | None) -> None:
        """A request relayed whole with a 2xx: its body does not kill replicas (router/poison.py)."""
        if fp and self.guard.completed(fp):
            log.info("fingerprint %s completed: its replica deaths are forgotten (not poison)", fp)

    def poison_failed(self, request_id: str, tenant_id: str, fp: str, tried: list[str], deaths: int) -> Failed:
        left = max(1, int(self.guard.refused_for(fp) + 0.999))
        msg = (f"This request was in flight when {self.guard.describe(fp)} died, and has not completed on any "
               f"replica since; the same request is refused for {left} s. Change the request (or contact the "
               f"operator with request id {request_id}).")
        body = json.dumps(error_body(msg, "invalid_request_error", "poison_request")).encode()
        return Failed(400, body, {"content-type": "application/json", "retry-after": str(left)}, len(tried), tried,
                      code="poison_request", deaths=deaths)

    async def open(
        self,
        ranked: list[RankedReplica],
        path: str,
        body: bytes,
        *,
        request_id: str,
        tenant_id: str,
        read_whole_body: bool,
        model_name: str | None = None,
        fingerprint: str | None = None,
        deadline: float | None = None,
        tenant_weight: float | None = None,
    ) -> Opened | Failed:
        headers = self._headers(request_id, tenant_id)
        if tenant_weight is not None:  # the tenant's fair-scheduling weight (the replica's engine)
            headers[TENANT_WEIGHT_HEADER] = f"{tenant_weight:g}"
        if model_name:  # the name the client asked for: the replica echoes it as `model` (vLLM does)
            headers[MODEL_NAME_HEADER] = model_name
        loop = asyncio.get_running_loop()
        tried: list[str] = []
        starting: list[str] = []  # tried replicas that are not answering yet (refused, or 503 not_ready)
        deaths = 0
        last_http: tuple[int, bytes, dict[str, str]] | None = None
        for attempt, cand in enumerate(ranked[: self.max_attempts], start=1):
            rid = cand.replica_id
            # a non-streamed answer is generated whole before its first byte: it gets the long limit,
            # and is given up as soon as the health checks take its replica out of routing (frozen)
            limit = self.non_stream_timeout if read_whole_body else self.first_byte_timeout
            by_deadline = False
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    return self._timed_out(tried, deaths)
                if read_whole_body or left < limit:
                    limit, by_deadline = left, True
            tried.append(rid)
            url = f"{cand.replica.url}{path}"
            timeout = self.timeout
            if read_whole_body:
                timeout = httpx.Timeout(connect=self.connect_timeout, read=limit + 1.0, write=30.0,
                                        pool=self.connect_timeout)
            req = self.http.build_request("POST", url, content=body, headers=self.upstream_headers(rid, headers),
                                          timeout=timeout)
            response: httpx.Response | None = None
            watch: asyncio.Task | None = None
            try:
                async with asyncio.timeout(limit) as scope:
                    if self.is_responsive(rid):
                        watch = asyncio.create_task(self._watch(rid, scope))
                    response = await self.http.send(req, stream=True)
                    if response.status_code >= 500 or response.status_code == 429:
                        content = await response.aread()
                        await response.aclose()
                        last_http = (response.status_code, content, _keep(response.headers))
                        if response.status_code == 503 and b'"not_ready"' in content and not cand.replica.started:
                            starting.append(rid)
                        log.warning(
                            "request %s: replica %s answered %d before the first byte; trying the next",
                            request_id, rid, response.status_code,
                        )  # fmt: skip
                        self.on_failover(f"http_{response.status_code}")
                        continue
                    rest = response.aiter_raw()
                    if read_whole_body:
                        first = b"".join([c async for c in rest])
                        rest = _empty()
                    else:
                        try:
                            first = await rest.__anext__()
                        except StopAsyncIteration:
                            first = b""
            except BaseException as e:
                if response is not None:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
                if not isinstance(e, httpx.HTTPError | TimeoutError | OSError):
                    raise  # cancelled (the client left) or a bug: not a replica failure
                left_routing = watch is not None and watch.done() and not watch.cancelled() and watch.result()
                if isinstance(e, TimeoutError) and by_deadline and not left_routing:
                    log.warning("request %s: its deadline passed while replica %s worked on it", request_id, rid)
                    return self._timed_out(tried, deaths)
                reason = _reason(e)
                if reason in ("connect", "connect_timeout", "timeout"):
                    self.on_failure(rid, reason)
                if reason == "connect" and not cand.replica.started:  # nothing listens on its port yet
                    starting.append(rid)
                if await self._died(cand, e):
                    deaths += 1
                    seen = self._record_death(rid, "before_first_byte", fingerprint)
                    log.warning(
                        "request %s tenant %s: replica %s died with it in flight (%s: %s); this body was in "
                        "flight when %d distinct replicas died", request_id, tenant_id, rid, reason, e, seen,
                    )  # fmt: skip
                    if fingerprint and self.guard.refused_for(fingerprint):
                        return self.poison_failed(request_id, tenant_id, fingerprint, tried, deaths)
                    if deaths > self.death_retries:
                        return self._died_failed(tried, deaths)
                    self.on_failover("died")
                    continue
                log.warning(
                    "request %s: replica %s failed before the first byte (%s: %s); trying the next",
                    request_id, rid, reason, e,
                )  # fmt: skip
                self.on_failover(reason)
                continue
            finally:
                if watch is not None:
                    watch.cancel()
            self.on_success(rid)
            ctype = response.headers.get("content-type", "")
            return Opened(
                ranked=cand,
                response=response,
                first=first,
                rest=rest,
                attempts=attempt,
                tried=tried,
                first_byte_at=time.perf_counter(),
                streaming="text/event-stream" in ctype,
                fingerprint=fingerprint,
                deadline=deadline,
                request_id=request_id,
                tenant_id=tenant_id,
            )
        if starting and len(starting) == len(tried) and not deaths:
            return self._starting_failed(tried, starting)
        if last_http is not None:
            status, content, hdrs = last_http
            return Failed(status, content, hdrs, len(tried), tried, deaths=deaths)
        if deaths:
            return self._died_failed(tried, deaths)
        msg = (
            f"No replica could serve the request (tried {', '.join(tried)})."
            if tried
            else "No replica serves this model right now."
        )
        body_out = json.dumps(error_body(msg, "server_error", "replica_unavailable")).encode()
        return Failed(503, body_out, {"content-type": "application/json"}, len(tried), tried)

    @staticmethod
    def _starting_failed(tried: list[str], starting: list[str]) -> Failed:
        """Every replica tried is still starting (its port refuses connections, or it answers 503
        not_ready): a 503 that says which, with Retry-After, instead of a generic 'no replica'."""
        names = ", ".join(dict.fromkeys(starting))
        msg = (f"The replicas for this model are still starting ({names}: not answering yet); "
               f"retry in {STARTING_RETRY_AFTER_S} s.")
        body = json.dumps(error_body(msg, "server_error", "replicas_starting")).encode()
        return Failed(503, body, {"content-type": "application/json", "retry-after": str(STARTING_RETRY_AFTER_S)},
                      len(tried), tried, code="replicas_starting")

    @staticmethod
    def _timed_out(tried: list[str], deaths: int) -> Failed:
        msg = "The request's deadline passed before its answer was ready (x-request-timeout)."
        body = json.dumps(error_body(msg, "server_error", "request_timeout")).encode()
        return Failed(504, body, {"content-type": "application/json"}, len(tried), tried, code="request_timeout",
                      deaths=deaths)

    @staticmethod
    def _died_failed(tried: list[str], deaths: int) -> Failed:
        msg = (f"The replica serving this request died while processing it (tried {', '.join(tried)}); "
               "it was not sent to another replica again.")
        body = json.dumps(error_body(msg, "server_error", "replica_died")).encode()
        return Failed(502, body, {"content-type": "application/json"}, len(tried), tried, code="replica_died",
                      deaths=deaths)

    async def _watch(self, replica_id: str, scope: asyncio.Timeout) -> bool:
        """Expire `scope` now once `replica_id` stops being responsive (taken out of routing)."""
        while True:
            await asyncio.sleep(0.25)
            if not self.is_responsive(replica_id):
                log.warning("replica %s left routing while a request waited on it; failing over", replica_id)
                scope.reschedule(asyncio.get_running_loop().time())
                return True

    def _check_death_later(self, opened: Opened, e: BaseException) -> None:
        """A stream broke mid-way: if its replica died, count the death against the body (no retry:
        the client already has part of the answer)."""

        async def check() -> None:
            if await self._died(opened.ranked, e):
                seen = self._record_death(opened.ranked.replica_id, "mid_stream", opened.fingerprint)
                log.warning("request %s tenant %s: replica %s died mid-stream; this body was in flight when %d "
                            "distinct replicas died", opened.request_id, opened.tenant_id, opened.ranked.replica_id, seen)

        task = asyncio.get_running_loop().create_task(check())
        self._death_checks.add(task)
        task.add_done_callback(self._death_checks.discard)

    async def relay(
        self, opened: Opened, scanner: UsageScanner, on_done: Callable[[str], None]
    ) -> AsyncIterator[bytes]:
        """The client's body: the first bytes, then the rest as it arrives, event by event.
        `on_done(outcome)` runs exactly once: "ok", "upstream_error" (the replica broke the stream),
        "deadline" (the request's deadline passed) or "client_closed" (the client went away; the
        upstream request is closed, which cancels it). SSE comments (`: keep-alive`) pass through."""
        outcome = "client_closed"
        buf = b""
        try:
            if not opened.streaming:
                chunks = [opened.first]
                try:
                    async for chunk in opened.rest:
                        chunks.append(chunk)
                except (httpx.HTTPError, OSError) as e:
                    log.warning("replica %s broke a response mid-way (%s)", opened.ranked.replica_id, e)
                    outcome = "upstream_error"
                    return
                whole = b"".join(chunks)
                scanner.feed_json(whole)
                outcome = "ok"
                yield whole
                return
            buf = opened.first
            cut = _event_boundary(buf)
            if cut:
                out, buf = buf[:cut], buf[cut:]
                scanner.feed_events(out)
                yield out
            rest = opened.rest
            loop = asyncio.get_running_loop()
            try:
                while True:
                    if opened.deadline is None:
                        chunk = await anext(rest, None)
                    else:
                        left = opened.deadline - loop.time()
                        if left <= 0:
                            raise TimeoutError
                        chunk = await asyncio.wait_for(anext(rest, None), left)
                    if chunk is None:
                        break
                    buf += chunk
                    cut = _event_boundary(buf)
                    if cut:
                        out, buf = buf[:cut], buf[cut:]
                        scanner.feed_events(out)
                        yield out
            except TimeoutError:
                log.warning("request %s: deadline passed mid-stream; ending it with an error event",
                            opened.request_id)
                outcome = "deadline"
                yield sse_error_event("The request's deadline passed (x-request-timeout); the response is "
                                      "incomplete.", code="request_timeout")
                return
            except (httpx.HTTPError, OSError) as e:
                log.warning(
                    "replica %s broke the stream mid-way (%s: %s); ending it with an error event",
                    opened.ranked.replica_id, type(e).__name__, e,
                )  # fmt: skip
                outcome = "upstream_error"
                if not isinstance(e, httpx.TimeoutException):
                    self._check_death_later(opened, e)
                yield sse_error_event(
                    f"The replica serving this request failed mid-stream ({type(e).__name__}); "
                    "the response is incomplete.",
                )
                return
            outcome = "ok"
            if buf.strip():
                scanner.feed_events(buf)
                yield buf
        finally:
            await opened.aclose()
            on_done(outcome)


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover


MODEL_NAME_HEADER = "x-lorafarm-model-name"
TENANT_WEIGHT_HEADER = "x-lorafarm-tenant-weight"


def _keep(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


def _reason(e: BaseException) -> str:
    if isinstance(e, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(e, httpx.ConnectError):
        return "connect"
    if isinstance(e, httpx.TimeoutException | TimeoutError):
        return "timeout"
    if isinstance(e, httpx.RemoteProtocolError):
        return "protocol"
    return "read"
