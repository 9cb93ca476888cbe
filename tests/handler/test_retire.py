"""Which adapter versions a replica retires when the routing table changes (handler/adapters/retire.py), and
that the Retirer unloads only what it holds, once per id. The unload's drain itself (running
requests finish first) is the cache's, tested in test_cache.py; the whole path runs in
tests/e2e/test_platform.py."""

from __future__ import annotations

import asyncio

from handler.adapters.retire import Retirer, to_retire


def table(aliases: dict[str, str], adapters: dict[str, str]) -> dict:
    return {"aliases": {a: {"adapter_id": i, "tenant_id": "t"} for a, i in aliases.items()},
            "adapters": {i: {"tenant_id": "t", "status": st} for i, st in adapters.items()}}


def test_to_retire():
    t0 = table({"t/a:prod": "v1", "t/b:prod": "b1"}, {"v1": "active", "v2": "active", "b1": "active", "x": "active"})
    # first table: nothing was aliased before, only disabled ones go
    assert to_retire(None, t0) == (set(), set())
    # deploy a -> v2: v1 retired; b unchanged; x never aliased stays (LRU's business)
    t1 = table({"t/a:prod": "v2", "t/b:prod": "b1"}, {"v1": "active", "v2": "active", "b1": "active", "x": "active"})
    assert to_retire(t0, t1) == ({"v1"}, set())
    # alias b deleted and b1 deleted from the registry: purge; x disabled: unload
    t2 = table({"t/a:prod": "v2"}, {"v1": "active", "v2": "active", "x": "disabled"})
    assert to_retire(t1, t2) == ({"x"}, {"b1"})
    # two aliases on one id: moving one keeps the id
    t3 = table({"t/a:prod": "v2", "t/a:canary": "v2"}, {"v2": "active"})
    t4 = table({"t/a:prod": "v3", "t/a:canary": "v2"}, {"v2": "active", "v3": "active"})
    assert to_retire(t3, t4) == (set(), set())


def test_to_retire_takes_the_registrys_mark():
    """An alias created and deployed away between two polls: the diff never saw the old version
    aliased; the registry's `retired` mark (an alias's previous target no alias points to) does."""
    t0 = table({}, {"v1": "active", "v2": "active"})
    t1 = table({"t/a:prod": "v2"}, {"v1": "active", "v2": "active"})
    t1["adapters"]["v1"]["retired"] = True
    assert to_retire(t0, t1) == ({"v1"}, set())
    assert to_retire(None, t1) == ({"v1"}, set())  # a replica that starts after the deploy
    t2 = table({"t/a:prod": "v2"}, {"v1": "active", "v2": "active", "v3": "active"})
    t2["adapters"]["v1"]["retired"] = True
    assert to_retire(t1, t2) == (set(), set())  # still marked: unloaded once, not at every table


class Cache:
    def __init__(self, held):
        self.held, self.unloaded = set(held), []

    def is_local(self, aid):
        return aid in self.held

    async def unload(self, aid, purge_disk=False):
        await asyncio.sleep(0.01)
        self.held.discard(aid)
        self.unloaded.append((aid, purge_disk))
        return {"removed": ["gpu"]}


class Registry:
    def __init__(self, tables):
        self.tables = list(tables)

    async def routing_table(self, etag, wait=0.0):
        if not self.tables:
            return None, etag  # 304
        return self.tables.pop(0), f"v{len(self.tables)}"


async def test_retirer_unloads_held_versions_once():
    t0 = table({"t/a:prod": "v1"}, {"v1": "active", "v0": "active"})
    t1 = table({"t/a:prod": "v2"}, {"v1": "active", "v2": "active"})  # v0 deleted, v1 retired
    cache = Cache({"v0", "v1", "v2"})
    r = Retirer(Registry([t0, t1]), cache)
    await r.step()
    await r.step()
    await r.step()  # 304: nothing new
    await asyncio.gather(*r.running.values())
    assert sorted(cache.unloaded) == [("v0", True), ("v1", False)] and r.retired == 2
    assert cache.held == {"v2"}
    # owners do not pull a retired version back (a periodic owner pull once refilled v1 after its unload)
    assert r.is_retired("v1") and r.is_retired("v0") and not r.is_retired("v2")


async def test_a_retired_version_aliased_again_is_no_longer_retired():
    t0 = table({"t/a:prod": "v1"}, {"v1": "active", "v2": "active"})
    t1 = table({"t/a:prod": "v2"}, {"v1": "active", "v2": "active"})
    t2 = table({"t/a:prod": "v1"}, {"v1": "active", "v2": "active"})  # rollback
    r = Retirer(Registry([t0, t1, t2]), Cache(set()))
    await r.step()
    await r.step()
    assert r.is_retired("v1")
    await r.step()
    assert not r.is_retired("v1") and r.is_retired("v2")
