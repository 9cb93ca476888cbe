"""Single-flight polling of many endpoints: at most one poll in flight per key.

`PollGroup.run(entries, poll_one, wait)` starts `poll_one(entry)` for every entry whose previous poll
has finished and waits at most `wait` seconds for all of them. A poll still running then keeps
running and no second one is started for its key, so one hung endpoint never delays the freshness
of the others. The replica view (router/view.py) and the foreign workers (router/workers.py) both
poll this way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any


class PollGroup:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}

    async def run(self, entries: Mapping[str, Any], poll_one: Callable[[Any], Awaitable[None]],
                  wait: float | None = None) -> None:
        tasks = []
        for key, entry in list(entries.items()):
            t = self._tasks.get(key)
            if t is None or t.done():
                t = self._tasks[key] = asyncio.create_task(poll_one(entry))
            tasks.append(t)
        if tasks:
            await asyncio.wait(tasks, timeout=wait)
        for key in [key for key, t in self._tasks.items() if t.done()]:
            del self._tasks[key]

    def cancel(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        self._tasks.clear()
