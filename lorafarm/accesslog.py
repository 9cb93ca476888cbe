"""Structured access logs for the registry and the replica: one JSON line per HTTP request on the
`lorafarm.access` logger, e.g.

    {"event": "access", "service": "replica", "method": "POST", "path": "/v1/chat/completions",
     "status": 200, "ms": 41.3, "client": "127.0.0.1", "request_id": "req-...", "adapter_id": "ad-..."}

Requests that only poll (health checks, /metrics, replica state, the routing table, heartbeats)
are logged at DEBUG, so an idle farm at the default INFO level prints nothing per second.
"""

from __future__ import annotations

import json
import logging
import re
import time

log = logging.getLogger("lorafarm.access")
POLLING = re.compile(r"^/(health|metrics|internal/routing|internal/replicas/[^/]+/(state|heartbeat))/?$")


def is_polling(method: str, path: str) -> bool:
    return bool(POLLING.match(path)) and method in ("GET", "POST", "HEAD")


def access_log_middleware(service: str):
    """An ASGI middleware (Litestar `middleware=[...]` entry) logging each request as above."""

    def factory(app):
        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            started = time.perf_counter()
            seen: dict = {"status": 500}

            async def send_wrapper(message):
                if message["type"] == "http.response.start":
                    seen["status"] = message["status"]
                    for k, v in message.get("headers", []):
                        name = k.decode("latin-1").lower()
                        if name in ("x-request-id", "x-adapter-id"):
                            seen[name.removeprefix("x-").replace("-", "_")] = v.decode("latin-1")
                await send(message)

            try:
                await app(scope, receive, send_wrapper)
            finally:
                method, path = scope.get("method", ""), scope.get("path", "")
                level = logging.DEBUG if is_polling(method, path) and seen["status"] < 400 else logging.INFO
                if log.isEnabledFor(level):
                    client = scope.get("client")
                    line = {"event": "access", "service": service, "method": method, "path": path,
                            "status": seen.pop("status"), "ms": round((time.perf_counter() - started) * 1000, 1),
                            "client": client[0] if client else None, **seen}
                    log.log(level, json.dumps(line, sort_keys=True))

        return middleware

    return factory


def quiet_polling_loggers() -> None:
    """httpx logs every outbound call at INFO (the 1 s polls): keep those at DEBUG."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
