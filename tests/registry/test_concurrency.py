"""Concurrent alias flips and uploads (many asyncio tasks against a real uvicorn server) leave a
consistent database: one row per adapter, one object per row, aliases that point at real adapters
of their tenant, and a routing version that counted every change."""

from __future__ import annotations

import asyncio
import random

from lorafarm.registry_client import RegistryClient, RegistryError
from tests.registry.helpers import ADMIN_TOKEN, live_server, make_adapter, unique


async def test_concurrent_uploads_and_alias_flips(make_settings, base_config, base_hash, tmp_path):
    from archives.store import open_store

    settings = make_settings()
    tenant = unique("conc")
    alias = f"{tenant}/live:prod"
    dirs = [make_adapter(tmp_path / f"a{i}", base_config, rank=4, seed=100 + i, trained_on=base_hash) for i in range(8)]
    with live_server(settings) as url:
        async with RegistryClient(url, ADMIN_TOKEN) as reg:
            await reg.create_tenant(tenant)
            v0 = (await reg.routing_table())[0]["version"]

            # 8 distinct adapters, each uploaded 3 times at once, every upload also deploying the alias.
            results = await asyncio.gather(*[
                reg.upload_adapter(d, tenant, alias=alias) for d in dirs for _ in range(3)
            ])
            by_id: dict[str, list[dict]] = {}
            for r in results:
                by_id.setdefault(r["adapter_id"], []).append(r)
            assert len(by_id) == 8
            for copies in by_id.values():
                assert sum(c["created"] for c in copies) == 1  # one created, the others found it
                assert len({c["checksum"] for c in copies}) == 1
            versions = sorted(c["version"] for copies in by_id.values() for c in copies[:1])
            assert len(set(versions)) == 8  # distinct versions, no duplicates under concurrency

            ids = list(by_id)
            # 60 concurrent deploys and rollbacks on the same alias.
            rng = random.Random(7)

            async def flip(i):
                if i % 4 == 3:
                    try:
                        return await reg.rollback_alias(alias)
                    except RegistryError as e:
                        assert e.status == 409  # nothing to roll back to: refused cleanly
                        return None
                return await reg.set_alias(alias, rng.choice(ids))

            answers = [a for a in await asyncio.gather(*[flip(i) for i in range(60)]) if a]
            for a in answers:
                assert a["adapter_id"] in ids and a["previous_adapter_id"] in ids + [None]

            final = await reg.get_alias(alias)
            assert final["adapter_id"] in ids and final["tenant_id"] == tenant
            assert final["previous_adapter_id"] in ids and final["previous_adapter_id"] != final["adapter_id"]
            table, _ = await reg.routing_table()
            assert table["aliases"][alias]["adapter_id"] == final["adapter_id"]
            assert table["version"] > v0 + 8  # 8 registrations at least, plus the flips

            # One row per adapter and one object per row; nothing orphaned in the store.
            listed = await reg.list_adapters(tenant)
            assert sorted(a["adapter_id"] for a in listed) == sorted(ids)
            async with open_store(settings.store_url) as store:
                keys = await store.list(f"adapters/{tenant}/")
                assert sorted(keys) == sorted(store.key_for(a["weights_uri"]) for a in listed)
            assert len(await reg.list_aliases(tenant)) == 1


async def test_concurrent_tenant_creation_and_stats(make_settings, canaries, base_hash):
    """The same tenant created by 10 tasks at once: one 201, nine clean 409s. Stats and heartbeats
    arriving together do not fail."""
    with live_server(make_settings()) as url:
        async with RegistryClient(url, ADMIN_TOKEN) as reg:
            name = unique("race")

            async def create():
                try:
                    return await reg.create_tenant(name)
                except RegistryError as e:
                    return e.status

            outcomes = await asyncio.gather(*[create() for _ in range(10)])
            assert sum(isinstance(o, dict) for o in outcomes) == 1
            assert sorted(o for o in outcomes if not isinstance(o, dict)) == [409] * 9
            assert len(await reg.list_keys(name)) == 1

            adapter = await reg.upload_adapter(canaries / "c0018", name)
            rids = [f"{name}-r{i}" for i in range(4)]
            await asyncio.gather(*[reg.join_replica(r, "http://127.0.0.1:1", base_hash, ["m"]) for r in rids])
            await asyncio.gather(
                *[reg.heartbeat(r) for r in rids for _ in range(5)],
                *[reg.push_stats(1.0, [{"adapter_id": adapter["adapter_id"], "requests": 1, "tokens": 50}])
                  for _ in range(20)],
            )
            assert (await reg.placement(adapter["adapter_id"]))["k"] == 2
