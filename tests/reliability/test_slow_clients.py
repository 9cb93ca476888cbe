"""Item 6: idle and half-sent client connections are closed by the router (request read deadline,
--request-timeout 8 in this farm), and a keyed client is served while they are open."""

from __future__ import annotations

import os
import socket
import time

from tests.reliability.conftest import client
from tests.waiting import wait_for

MSG = [{"role": "user", "content": "hello"}]
PER_KIND = 60


def _open(addr, first: bytes) -> socket.socket:
    s = socket.create_connection(addr, timeout=10)
    if first:
        s.sendall(first)
    return s


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(65536) in (b"",) or _closed_by_peer(s, timeout)  # a 408/400 first, then EOF
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_and_half_sent_connections_are_closed(rfarm, rtenant, markers):
    host, port = rfarm["router_url"].removeprefix("http://").split(":")
    addr = (host, int(port))
    router_pid = rfarm["_farm"].procs["router"].pid
    baseline = _fds(router_pid)
    kinds = {
        "idle": b"",
        "half_headers": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bea",
        "half_body": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": \"x\", "),
    }
    socks = {kind: [_open(addr, first) for _ in range(PER_KIND)] for kind, first in kinds.items()}
    held = _fds(router_pid)
    try:
        # a keyed client is served while they are held open
        alias = sorted(rtenant["aliases"])[0]
        r = client(rfarm, rtenant["api_key"], timeout=30).chat.completions.create(
            model=alias, messages=MSG, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == markers[alias]
        started = time.monotonic()
        for kind, group in socks.items():
            for s in group:
                assert _closed_by_peer(s, 30.0), f"a {kind} connection was not closed"
        print(f"slow clients: {3 * PER_KIND} connections (router fds {baseline} -> {held}) all closed "
              f"{time.monotonic() - started:.1f} s after the keyed request")
    finally:
        for group in socks.values():
            for s in group:
                s.close()
    wait_for(lambda: _fds(router_pid) <= baseline + 10, 15, what="router file descriptors back to baseline")
