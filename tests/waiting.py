"""The suite's one way to wait for something: poll a condition until it holds, and when it does not,
fail saying what was awaited, for how long, what the condition last returned (or raised), and the
ends of the logs that explain it (the replica's, the router's).

Tests wait on conditions, never on fixed sleeps; a deadline only bounds a hang. `wait_for` is for
plain test code, `wait_until` for tests running on an event loop (service tests on uvicorn threads).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

TAIL_LINES = 40

# a process restarting refuses connections for a while: that is "not yet", not a failure
try:
    import httpx

    NOT_YET: tuple[type[BaseException], ...] = (OSError, httpx.HTTPError)
except ImportError:  # pragma: no cover - httpx is a dev dependency
    NOT_YET = (OSError,)

Logs = Path | str | Callable[[], str] | Iterable[Path | str | Callable[[], str]] | None


def wait_for(predicate: Callable, timeout: float, *, what: str | None = None, interval: float = 0.1,
             logs: Logs = None):
    """Poll `predicate()` until it is truthy and return its value; after `timeout` s fail the test
    (see the module doc). `logs`: log files, folders of *.log, or callables returning text."""
    w = _Wait(predicate, timeout, what, logs)
    while (value := w.poll()) is None:
        time.sleep(interval)
    return value


async def wait_until(predicate: Callable, timeout: float = 10.0, interval: float = 0.02, *,
                     what: str | None = None, logs: Logs = None):
    """`wait_for` on an event loop (the loop keeps running between polls). The predicate may return
    an awaitable (an async check, or `asyncio.to_thread(blocking_check)`), which is awaited. Returns
    the value, so `assert await wait_until(...)` reads as before; a timeout fails with the full
    message."""
    w = _Wait(predicate, timeout, what, logs)
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except NOT_YET as e:
            value = e
        if (value := w.check(value)) is not None:
            return value
        await asyncio.sleep(interval)


class _Wait:
    def __init__(self, predicate: Callable, timeout: float, what: str | None, logs: Logs):
        self.predicate, self.timeout, self.what, self.logs = predicate, timeout, what, logs
        self.started = time.monotonic()
        self.last: object = None

    def poll(self):
        """The predicate's value when truthy, else None; fails the test once the deadline has passed."""
        try:
            value = self.predicate()
        except NOT_YET as e:
            value = e
        return self.check(value)

    def check(self, value):
        """`value` when truthy (and not a "not yet" error), else None; fails the test past the deadline."""
        if value and not isinstance(value, BaseException):
            return value
        self.last = value
        waited = time.monotonic() - self.started
        if waited > self.timeout:
            msg = f"waited {waited:.1f} s for {self.what or describe(self.predicate)}: not reached (last: {self.last!r})"
            tails = log_tails(self.logs)
            pytest.fail(msg + ("\n" + tails if tails else ""))
        return None


def describe(predicate: Callable) -> str:
    """The condition in words: its source line for a lambda, else its name."""
    try:
        return " ".join(inspect.getsource(predicate).split())[:300]
    except (OSError, TypeError):
        return getattr(predicate, "__qualname__", repr(predicate))


def log_tails(logs: Logs, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of each log (a file, every *.log of a folder, or a callable's text)."""
    if logs is None:
        return ""
    items = [logs] if isinstance(logs, (str, Path)) or callable(logs) else list(logs)
    out = []
    for item in items:
        if callable(item):
            try:
                out.append(item())
            except Exception as e:  # noqa: BLE001 - diagnostics must not hide the failure
                out.append(f"(diagnostics unavailable: {e!r})")
            continue
        path = Path(item)
        for f in sorted(path.glob("*.log")) if path.is_dir() else [path]:
            if f.exists():
                tail = f.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {f.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out)
