"""Retiring old adapter versions on a replica.

Versions are immutable ids; a deploy moves an alias to a new id. The version the alias left keeps
its device slot and RAM until LRU pressure evicts it, which on a busy replica is slot space taken
from live versions. So the replica watches the registry's routing table and, for every adapter it
holds that

- was the target of an alias in the previous table and is the target of none now (retired by a
  deploy, a rollback or an alias delete), or is newly marked `retired` by the registry (a deploy
  moved an alias away from it: this catches a version aliased and deployed away between two
  polls, which the diff alone never sees as aliased),
- is disabled, or
- is gone from the table (deleted: its disk copy is purged too),

calls `cache.unload(id)`, which lets running requests on it finish (new ones wait), then frees
its slot and RAM. A request for a retired id by name still works: it loads the adapter again.
Adapters called only by id (never aliased) are left to LRU.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("lorafarm.replica.retire")


def pointed(table: dict) -> set[str]:
    """Adapter ids some alias points to."""
    return {str(a.get("adapter_id")) for a in (table.get("aliases") or {}).values() if a.get("adapter_id")}


def marked_retired(table: dict) -> set[str]:
    """Ids the registry marks retired (an alias's previous target that no alias points to)."""
    return {a for a, info in (table.get("adapters") or {}).items() if info.get("retired")}


def to_retire(previous: dict | None, table: dict) -> tuple[set[str], set[str]]:
    """(ids to unload, ids to unload and purge from disk) going from `previous` to `table`."""
    adapters = table.get("adapters") or {}
    unload = {a for a, info in adapters.items() if str(info.get("status") or "active") == "disabled"}
    purge: set[str] = set()
    # newly marked only: a retired id called by name loads again, and stays until LRU or the next mark
    unload |= marked_retired(table) - (marked_retired(previous) if previous is not None else set())
    if previous is not None:
        unload |= pointed(previous) - pointed(table)
        purge = set(previous.get("adapters") or {}) - set(adapters)
    return unload - purge, purge


class Retirer:
    """Long-polls the routing table (ETag: the registry holds a 304 until the table changes) and
    unloads retired versions."""

    def __init__(self, registry, cache, interval_s: float = 2.0, long_poll_s: float = 20.0):
        self.registry, self.cache, self.interval_s = registry, cache, interval_s
        # a poll a second was a request on the serving loop and a database read in the registry every
        # second of an idle farm; held, it is one per change (or per long_poll_s), seen at once
        self.long_poll_s = long_poll_s
        self.previous: dict | None = None
        self.etag: str | None = None
        self.running: dict[str, asyncio.Task] = {}
        self.pending: dict[str, bool] = {}  # retired ids not unloaded yet -> purge disk; retried each step
        self.retired = 0  # unloads done (for tests and metrics)
        self.unaliased: set[str] = set()  # retired by a deploy and not aliased again since

    def is_retired(self, adapter_id: str) -> bool:
        """A deploy retired it and no alias points to it again: owners must not pull it back."""
        return adapter_id in self.unaliased

    async def step(self, wait: float = 0.0) -> None:
        table, self.etag = await self.registry.routing_table(self.etag, wait=wait)
        if table is not None:
            unload, purge = to_retire(self.previous, table)
            self.unaliased = (self.unaliased | unload | purge) - pointed(table)
            self.previous = table
            for aid in unload | purge:
                self.pending[aid] = self.pending.get(aid, False) or aid in purge
        for aid, purge in sorted(self.pending.items()):
            if not self.cache.is_local(aid):
                self.pending.pop(aid, None)
            elif aid not in self.running:
                self.running[aid] = asyncio.create_task(self._unload(aid, purge), name=f"retire-{aid}")

    async def _unload(self, aid: str, purge: bool) -> None:
        try:
            removed = await self.cache.unload(aid, purge_disk=purge)
            self.retired += 1
            self.pending.pop(aid, None)
            log.info("retired %s (%s): %s", aid, "deleted" if purge else "no alias points to it / disabled",
                     removed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # kept pending: the next step tries again
            log.warning("retiring %s failed (will retry): %s", aid, e)
        finally:
            self.running.pop(aid, None)

    async def run(self) -> None:
        failed = True  # the first read is plain: the table at once, then held polls
        while True:
            started = time.monotonic()
            try:
                await self.step(wait=0.0 if failed else self.long_poll_s)
                failed = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the registry loop logs registry trouble; this one stays quiet
                log.debug("routing table not read: %s", e)
                failed = True
            # held polls go again at once (a change was just seen), but not more than about once a
            # second while the table keeps changing; a failed one waits the plain interval
            gap = self.interval_s if failed or self.long_poll_s <= 0 else 1.0
            await asyncio.sleep(max(0.0, gap - (time.monotonic() - started)))

    async def stop(self) -> None:
        for t in list(self.running.values()):
            t.cancel()
