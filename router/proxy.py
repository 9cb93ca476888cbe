"""Forwarding to replicas with httpx: failover before the first byte, unbuffered SSE after it.

`Proxy.open()` tries the ranked replicas in order until one gives a usable first byte:
- a refused/reset connection, a timeout, or a 5xx/429 answer before any body byte is a failover:
  the next replica is tried (up to max_attempts), and connection failures count against the
  replica's health;
- a 2xx or 4xx answer is committed: its first body chunk is already in hand, so a replica that
  dies between the headers and the first byte is also failed over.
For a non-streamed request the whole body is read before anything reaches the client, so any
failure there is still "before the first byte".

`relay()` then passes the SSE stream through event by event as the bytes arrive (it only holds
back an incomplete event, so the client never sees half an event); if the replica fails
mid-stream, the client gets an OpenAI error event and `data: [DONE]`, never silence or a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
import httpx

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


@dataclass
class UsageScanner:
    """Watches the events going by: the usage chunk and how many content chunks passed."""

    usage: dict | None = None
    content_events: int = 0
    first_token_at: float | None = None  # perf_counter when the first non-empty token passed

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
        try:
            obj = json.loads(body)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]


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
        is_responsive: Callable[[str], bool] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        on_success: Callable[[str], None] | None = None,
        on_failover: Callable[[str], None] | None = None,
        upstream_headers: Callable[[str, dict[str, str]], dict[str, str]] | None = None,
    ):
        self.http = http
        self.admin_token = admin_token
        self.max_attempts = max_attempts
        # streams: read_timeout between two chunks; a non-streamed answer comes whole, after its generation
        self.timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=30.0, pool=connect_timeout)
        self.whole_timeout = httpx.Timeout(connect=connect_timeout, read=non_stream_timeout, write=30.0,
                                           pool=connect_timeout)
        self.first_byte_timeout = first_byte_timeout
        self.read_timeout = read_timeout
        self.non_stream_timeout = non_stream_timeout
        self.is_responsive = is_responsive or (lambda rid: True)
        self.on_failure = on_failure or (lambda rid, why: None)
        self.on_success = on_success or (lambda rid: None)
        self.on_failover = on_failover or (lambda reason: None)
        # per-upstream headers (a foreign worker gets its own key, never the admin token)
        self.upstream_headers = upstream_headers or (lambda replica_id, h: h)

    def _headers(self, request_id: str, tenant_id: str) -> dict[str, str]:
        h = {"content-type": "application/json", "x-request-id": request_id, "x-lorafarm-tenant": tenant_id}
        if self.admin_token:
            h["authorization"] = f"Bearer {self.admin_token}"
        return h

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
    ) -> Opened | Failed:
        headers = self._headers(request_id, tenant_id)
        if model_name:  # the name the client asked for: the replica echoes it as `model` (vLLM does)
            headers[MODEL_NAME_HEADER] = model_name
        tried: list[str] = []
        last_http: tuple[int, bytes, dict[str, str]] | None = None
        for attempt, cand in enumerate(ranked[: self.max_attempts], start=1):
            rid = cand.replica_id
            tried.append(rid)
            url = f"{cand.replica.url}{path}"
            req = self.http.build_request("POST", url, content=body, headers=self.upstream_headers(rid, headers),
                                          timeout=self.whole_timeout if read_whole_body else self.timeout)
            response: httpx.Response | None = None
            watch: asyncio.Task | None = None
            try:
                # a non-streamed answer is generated whole before its first byte: it gets the long limit,
                # and is given up as soon as the health checks take its replica out of routing (frozen)
                limit = self.non_stream_timeout if read_whole_body else self.first_byte_timeout
                async with asyncio.timeout(limit) as scope:
                    if self.is_responsive(rid):
                        watch = asyncio.create_task(self._watch(rid, scope))
                    response = await self.http.send(req, stream=True)
                    if response.status_code >= 500 or response.status_code == 429:
                        content = await response.aread()
                        await response.aclose()
                        last_http = (response.status_code, content, _keep(response.headers))
                        log.warning(
                            "request %s: replica %s answered %d before the first byte; trying the next",
                            request_id, rid, response.status_code,
                        )  # fmt: skip
                        self.on_failover(f"http_{response.status_code}")
                        continue
                    rest = response.aiter_raw()
                    if read_whole_body:
                        first = b"".join([c async for c in rest])

                        async def _empty() -> AsyncIterator[bytes]:
                            return
                            yield b""  # pragma: no cover

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
                reason = _reason(e)
                if reason in ("connect", "connect_timeout", "timeout"):
                    self.on_failure(rid, reason)
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
            )
        if last_http is not None:
            status, content, hdrs = last_http
            return Failed(status, content, hdrs, len(tried), tried)
        msg = (
            f"No replica could serve the request (tried {', '.join(tried)})."
            if tried
            else "No replica serves this model right now."
        )
        body_out = json.dumps(error_body(msg, "server_error", "replica_unavailable")).encode()
        return Failed(503, body_out, {"content-type": "application/json"}, len(tried), tried)

    async def _watch(self, replica_id: str, scope: asyncio.Timeout) -> None:
        """Expire `scope` now once `replica_id` stops being responsive (taken out of routing)."""
        while True:
            await asyncio.sleep(0.25)
            if not self.is_responsive(replica_id):
                log.warning("replica %s left routing while a request waited on it; failing over", replica_id)
                scope.reschedule(asyncio.get_running_loop().time())
                return

    async def relay(
        self, opened: Opened, scanner: UsageScanner, on_done: Callable[[str], None]
    ) -> AsyncIterator[bytes]:
        """The client's body: the first bytes, then the rest as it arrives, event by event.
        `on_done(outcome)` runs exactly once: "ok", "upstream_error" (the replica broke the stream)
        or "client_closed" (the client went away; the upstream request is closed, which cancels it)."""
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
            try:
                async for chunk in opened.rest:
                    buf += chunk
                    cut = _event_boundary(buf)
                    if cut:
                        out, buf = buf[:cut], buf[cut:]
                        scanner.feed_events(out)
                        yield out
            except (httpx.HTTPError, OSError) as e:
                log.warning(
                    "replica %s broke the stream mid-way (%s: %s); ending it with an error event",
                    opened.ranked.replica_id, type(e).__name__, e,
                )  # fmt: skip
                outcome = "upstream_error"
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


MODEL_NAME_HEADER = "x-lorafarm-model-name"


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
