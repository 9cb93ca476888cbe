"""uvicorn with limits against slow and idle clients, for the router and the replica.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection that
sends nothing, or half its headers, or half its body, is held forever. `serve()` runs uvicorn with
an HTTP protocol that gives every request `request_timeout` seconds from its first byte (or from
the connection's opening) to its last body byte, then closes the connection; plus a keep-alive
timeout, a cap on header size (h11) and `limit_concurrency` (connections + requests; above it
uvicorn answers 503)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import uvicorn

log = logging.getLogger("lorafarm.serving")


@dataclass
class ClientLimits:
    request_timeout: float = 30.0  # connection open / first byte of a request -> its whole body read
    keep_alive_timeout: float = 5.0  # idle between two requests
    max_connections: int = 4096  # connections + requests in progress; 503 above
    max_header_bytes: int = 16 * 1024  # h11 only (httptools has its own fixed limit)


def timed_protocol(base: type, request_timeout: float) -> type:
    """`base` (a uvicorn HTTP protocol class) with a read deadline per request."""

    class TimedProtocol(base):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            reading = cycle is not None and not cycle.response_complete and cycle.more_body
            idle = cycle is None or cycle.response_complete
            if cycle is not None and not cycle.more_body and not idle:
                self._disarm()  # this request is read whole: the app has it
            elif self._deadline is None and (idle or reading):
                self._arm()  # the first bytes of a next request on a kept-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            cycle = getattr(self, "cycle", None)
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                return  # read whole meanwhile: being answered
            if not self.transport.is_closing():
                log.warning("closing a client connection: its request was not read whole within %.0f s "
                            "(--request-timeout)", request_timeout)
                self.transport.close()

    TimedProtocol.__name__ = f"Timed{base.__name__}"
    return TimedProtocol


def serve(app, host: str, port: int, limits: ClientLimits | None = None, **kw) -> None:
    """uvicorn.run(app, ...) with `limits` against slow and idle clients."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    limits = limits or ClientLimits()
    uvicorn.run(
        app,
        host=host,
        port=port,
        http=timed_protocol(AutoHTTPProtocol, limits.request_timeout),
        timeout_keep_alive=max(1, round(limits.keep_alive_timeout)),
        limit_concurrency=limits.max_connections,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **kw,
    )


class ClientGone(Exception):
    """The client disconnected before the awaited result was ready."""


async def until_disconnect(receive) -> None:
    """Return when the ASGI client disconnects (call it once the request body is read)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


async def unless_disconnected(receive, coro: Awaitable, discard: Callable | None = None):
    """Await `coro`; if the client disconnects first, cancel it and raise ClientGone. A result that
    arrives anyway (it finished just as the client left) is handed to `discard` (sync or async)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        result = None
        with contextlib.suppress(BaseException):
            result = await task
        if result is not None and discard is not None:
            out = discard(result)
            if inspect.isawaitable(out):
                await out
        raise ClientGone()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
