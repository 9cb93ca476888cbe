"""Registry HTTP API behaviour through Litestar's AsyncTestClient: tenants and keys, uploads
(files and tar, idempotency, versions), archive download, routing table ETags, replica liveness
and placements reported by heartbeats, migrations."""

from __future__ import annotations

import asyncio
import io
import tarfile

from tests.registry.helpers import BASE_NAME, app_client, unique, upload_files
from tests.waiting import wait_until


async def _tenant(client) -> str:
    name = unique("api")
    r = await client.post("/internal/tenants", json={"name": name, "requests_per_s": 2.5})
    assert r.status_code == 201, r.text
    return name


async def test_health_and_openapi(client):
    r = await client.get("/health", headers={"Authorization": ""})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    schema = (await client.get("/schema/openapi.json", headers={"Authorization": ""})).json()
    assert schema["components"]["securitySchemes"]["AdminToken"] == {"type": "http", "scheme": "bearer",
                                                                       "description": "the registry's admin token"}
    for path in ("/internal/adapters/upload", "/internal/aliases/{tenant_id}/{name}/rollback", "/internal/routing",
                 "/internal/placements/{adapter_id}", "/internal/stats", "/internal/auth/verify"):
        assert path in schema["paths"]


async def test_tenants_keys_verify(client):
    tenant = await _tenant(client)
    listed = (await client.get("/internal/tenants")).json()
    mine = next(t for t in listed if t["tenant_id"] == tenant)
    assert mine["requests_per_s"] == 2.5 and mine["tokens_per_s"] is None
    k = (await client.post(f"/internal/tenants/{tenant}/keys")).json()
    assert set(k) == {"key_id", "api_key"}
    keys = (await client.get(f"/internal/tenants/{tenant}/keys")).json()
    assert len(keys) == 2 and all(set(x) == {"key_id", "prefix", "created_at", "revoked_at"} for x in keys)
    assert any(k["api_key"].startswith(x["prefix"]) for x in keys)
    ok = await client.post("/internal/auth/verify", json={"api_key": k["api_key"]})
    assert ok.status_code == 200 and ok.json()["tenant_id"] == tenant
    assert (await client.delete(f"/internal/tenants/{tenant}/keys/{k['key_id']}")).status_code == 204
    assert (await client.delete(f"/internal/tenants/{tenant}/keys/{k['key_id']}")).status_code == 204  # idempotent
    r = await client.post("/internal/auth/verify", json={"api_key": k["api_key"]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    revoked = [x for x in (await client.get(f"/internal/tenants/{tenant}/keys")).json() if x["revoked_at"]]
    assert [x["key_id"] for x in revoked] == [k["key_id"]]


async def test_keys_stored_hashed(client):
    """The database never holds an API key in clear."""
    from sqlalchemy import select

    from registry.db import make_engine
    from registry.tables import ApiKey

    tenant = unique("hash")
    created = (await client.post("/internal/tenants", json={"name": tenant})).json()
    engine = make_engine(client.app.state.registry.settings.database_url)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(select(ApiKey).where(ApiKey.tenant_id == tenant))).one()
    finally:
        await engine.dispose()
    assert created["api_key"] not in [str(v) for v in row]
    assert row.key_hash != created["api_key"] and len(row.key_hash) == 64


async def test_upload_files_tar_versions_and_download(client, canaries, tmp_path, base_hash):
    from archives.verify import verify_archive

    tenant = await _tenant(client)
    r1 = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "base_model": BASE_NAME},
                           files=upload_files(canaries / "c0010"))
    assert r1.status_code == 201, r1.text
    a1 = r1.json()
    assert a1["version"] == 1 and a1["created"] is True and a1["alias"] is None

    # The same adapter as a tar (in a folder, with a README): same content, same id, 200.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors", "base_model_hash.txt", "README.md"):
            tar.add(canaries / "c0010" / name, arcname=f"run-7/{name}")
    etag = (await client.get("/internal/routing")).headers["etag"]
    r2 = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "alias": f"{tenant}/x:prod"},
                           files=[("archive", ("adapter.tar", buf.getvalue(), "application/x-tar"))])
    assert r2.status_code == 200, r2.text
    assert r2.json()["adapter_id"] == a1["adapter_id"] and r2.json()["created"] is False
    assert r2.json()["alias"] == f"{tenant}/x:prod"
    table = await client.get("/internal/routing", headers={"If-None-Match": etag})
    assert table.status_code == 200  # the new alias changed the table
    assert table.json()["aliases"][f"{tenant}/x:prod"]["adapter_id"] == a1["adapter_id"]

    # Same files, another tenant: another id. Next upload of this tenant: version 2; explicit version kept.
    other = await _tenant(client)
    r3 = await client.post("/internal/adapters/upload", data={"tenant_id": other}, files=upload_files(canaries / "c0010"))
    assert r3.status_code == 201 and r3.json()["adapter_id"] != a1["adapter_id"]
    r4 = await client.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=upload_files(canaries / "c0011"))
    assert r4.json()["version"] == 2
    r5 = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "version": "7"},
                           files=upload_files(canaries / "c0012"))
    assert r5.json()["version"] == 7

    assert [a["adapter_id"] for a in (await client.get("/internal/adapters", params={"tenant_id": tenant})).json()] == [
        a1["adapter_id"], r4.json()["adapter_id"], r5.json()["adapter_id"]]
    got = await client.get(f"/internal/adapters/{a1['adapter_id']}")
    assert got.status_code == 200 and got.json()["checksum"] == a1["checksum"]
    assert (await client.get("/internal/adapters/ad-" + "9" * 20)).status_code == 404

    r = await client.get(f"/internal/adapters/{a1['adapter_id']}/archive")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-tar")
    lar = tmp_path / "a.lar"
    lar.write_bytes(r.content)
    m = verify_archive(lar, [client.app.state.registry.public_key], base_model_hash=base_hash)
    assert m.adapter_id == a1["adapter_id"] and len(r.content) == a1["size_bytes"]
    assert (await client.get("/internal/adapters/ad-" + "9" * 20 + "/archive")).status_code == 404


async def test_routing_etag(client, canaries, base_hash):
    r = await client.get("/internal/routing")
    etag = r.headers["etag"]
    assert r.json()["version"] >= 1 and r.json()["base_models"][BASE_NAME] == base_hash
    again = await client.get("/internal/routing", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.headers["etag"] == etag and not again.content
    # A tenant or a key does not change the table; an adapter, an alias, a replica do.
    tenant = await _tenant(client)
    assert (await client.get("/internal/routing", headers={"If-None-Match": etag})).status_code == 304
    for change in (
        lambda: client.post("/internal/adapters/upload", data={"tenant_id": tenant, "alias": f"{tenant}/a:b"},
                            files=upload_files(canaries / "c0013")),
        lambda: client.post("/internal/replicas/join", json={"replica_id": f"{tenant}-r", "url": "http://h:1",
                                                             "base_model_hash": base_hash, "models": [BASE_NAME]}),
    ):
        assert (await change()).status_code in (200, 201)
        r = await client.get("/internal/routing", headers={"If-None-Match": etag})
        assert r.status_code == 200 and r.headers["etag"] != etag
        etag = r.headers["etag"]
    # Re-joining unchanged and plain heartbeats keep the table (and the ETag).
    assert (await client.post("/internal/replicas/join", json={"replica_id": f"{tenant}-r", "url": "http://h:1",
                                                               "base_model_hash": base_hash, "models": [BASE_NAME]}
                              )).status_code == 200
    assert (await client.post(f"/internal/replicas/{tenant}-r/heartbeat")).status_code == 200
    assert (await client.get("/internal/routing", headers={"If-None-Match": etag})).status_code == 304
    assert (await client.get("/internal/routing", headers={"If-None-Match": '"v0", ' + etag})).status_code == 304


async def test_a_held_routing_poll_wakes_on_a_version_write(database_url):
    """`Database.changed`, what a held routing poll waits on: it returns when a write through this
    registry grows the version (bounded here by 30 s against its 60 s timeout, so only the wake can
    answer in time), and a write that does not grow it wakes nothing."""
    from registry.db import Database

    db = await Database.open(database_url)
    try:
        held = asyncio.create_task(db.changed(60))
        event = db._changed  # noqa: SLF001 - what the held poll waits on
        async with db.write():
            pass  # no bump: nothing to tell
        assert db._changed is event and not event.is_set()  # noqa: SLF001
        async with db.write() as session:
            await db.bump(session)
        assert event.is_set()
        await asyncio.wait_for(held, 30)
    finally:
        await db.close()


async def test_replicas_down_after_timeout_and_back(make_settings, base_hash):
    async with app_client(make_settings(replica_timeout_s=0.6, sweep_interval_s=0.2)) as c:
        rid = unique("rep")
        j = await c.post("/internal/replicas/join", json={"replica_id": rid, "url": "http://127.0.0.1:8201",
                                                          "base_model_hash": base_hash, "models": [BASE_NAME],
                                                          "capacity_weight": 2.0})
        assert j.status_code == 200 and j.json()["status"] == "up" and j.json()["capacity_weight"] == 2.0

        async def status():
            return next(r["status"] for r in (await c.get("/internal/replicas")).json() if r["replica_id"] == rid)

        async def down():
            return await status() == "down"

        await wait_until(down, 10, interval=0.2, what=f"{rid} down")
        table = (await c.get("/internal/routing")).json()
        assert next(r for r in table["replicas"] if r["replica_id"] == rid)["status"] == "down"
        hb = await c.post(f"/internal/replicas/{rid}/heartbeat")
        assert hb.status_code == 200 and hb.json()["status"] == "up"
        assert (await c.post("/internal/replicas/nobody/heartbeat")).status_code == 404


async def test_heartbeat_state_fills_placements(client, canaries, base_hash):
    from sqlalchemy import select

    from registry.db import make_engine
    from registry.tables import Placement

    tenant = await _tenant(client)
    ids = []
    for c in ("c0014", "c0015"):
        r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=upload_files(canaries / c))
        ids.append(r.json()["adapter_id"])
    rid = f"{tenant}-r0"
    await client.post("/internal/replicas/join", json={"replica_id": rid, "url": "http://h:2",
                                                       "base_model_hash": base_hash, "models": [BASE_NAME]})
    state = {"replica_id": rid, "base_model_hash": base_hash, "models": [BASE_NAME], "gpu_adapters": [ids[0]],
             "ram_adapters": [ids[1], "ad-" + "e" * 20], "queue_depth": 1, "tokens_in_flight": 40}
    assert (await client.post(f"/internal/replicas/{rid}/heartbeat", json=state)).status_code == 200
    bad = await client.post(f"/internal/replicas/{rid}/heartbeat", json={**state, "replica_id": "someone"})
    assert bad.status_code == 422

    async def rows():
        engine = make_engine(client.app.state.registry.settings.database_url)
        try:
            async with engine.connect() as conn:
                res = await conn.execute(select(Placement.adapter_id, Placement.tier, Placement.role)
                                         .where(Placement.replica_id == rid))
                return {a: (t, role) for a, t, role in res.all()}
        finally:
            await engine.dispose()

    got = await rows()
    assert {a: t for a, (t, _) in got.items()} == {ids[0]: "gpu", ids[1]: "ram"}
    assert all(role == "owner" for _, role in got.values())  # the only replica owns everything
    state["gpu_adapters"], state["ram_adapters"] = [ids[1]], []
    await client.post(f"/internal/replicas/{rid}/heartbeat", json=state)
    assert {a: t for a, (t, _) in (await rows()).items()} == {ids[1]: "gpu"}


async def test_alias_deploy_rollback_cycle(client, canaries):
    tenant = await _tenant(client)
    a, b = [
        (await client.post("/internal/adapters/upload", data={"tenant_id": tenant},
                           files=upload_files(canaries / c))).json()["adapter_id"]
        for c in ("c0016", "c0017")
    ]
    path = f"/internal/aliases/{tenant}/support:prod"
    first = (await client.put(path, json={"adapter_id": a})).json()
    assert first["previous_adapter_id"] is None and first["tenant_id"] == tenant
    assert (await client.put(path, json={"adapter_id": a})).json()["previous_adapter_id"] is None  # no-op
    assert (await client.put(path, json={"adapter_id": b})).json()["previous_adapter_id"] == a
    routing = (await client.get("/internal/routing")).json()["adapters"]
    assert (routing[a]["retired"], routing[b]["retired"]) == (True, False)  # replicas free a's slot
    back = (await client.post(f"{path}/rollback")).json()
    assert (back["adapter_id"], back["previous_adapter_id"]) == (a, b)
    fwd = (await client.post(f"{path}/rollback")).json()
    assert (fwd["adapter_id"], fwd["previous_adapter_id"]) == (b, a)
    # The slash of the alias may also come percent-encoded.
    enc = await client.get(f"/internal/aliases/{tenant}%2Fsupport:prod")
    assert enc.status_code == 200 and enc.json()["adapter_id"] == b
    assert [x["alias"] for x in (await client.get("/internal/aliases", params={"tenant_id": tenant})).json()] == [
        f"{tenant}/support:prod"]


async def test_migrations_idempotent_and_reversible(database_url):
    from sqlalchemy import inspect

    from registry.db import make_engine, migrate

    engine = make_engine(database_url)
    try:
        await migrate(engine)  # already at head: a no-op
        async with engine.connect() as conn:
            tables = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
        assert {"adapters", "aliases", "placements", "adapter_stats", "tenants", "api_keys", "replicas",
                "registry_state", "alembic_version"} <= tables

        # The SQLModel tables and the migrations describe the same schema (no autogenerate drift).
        from alembic.autogenerate import compare_metadata
        from alembic.migration import MigrationContext
        from sqlmodel import SQLModel

        from registry.tables import ALL_TABLES

        ours = {t.__tablename__ for t in ALL_TABLES}

        def drift(conn):
            mc = MigrationContext.configure(conn, opts={
                "compare_type": True,
                "include_object": lambda obj, name, type_, *_: type_ != "table" or name in ours,
            })
            return compare_metadata(mc, SQLModel.metadata)

        async with engine.connect() as conn:
            assert await conn.run_sync(drift) == []
    finally:
        await engine.dispose()


async def test_migrations_from_scratch(tmp_path):
    """A fresh database goes to head, down to base and back (SQLite file)."""
    from sqlalchemy import inspect

    from registry.db import make_engine, migrate

    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    try:
        await migrate(engine)
        await migrate_down(engine)
        async with engine.connect() as conn:
            assert set(await conn.run_sync(lambda c: inspect(c).get_table_names())) <= {"alembic_version"}
        await migrate(engine)
        async with engine.connect() as conn:
            assert "adapters" in await conn.run_sync(lambda c: inspect(c).get_table_names())
    finally:
        await engine.dispose()


async def migrate_down(engine):
    from alembic import command

    from registry.db import _alembic_config

    async with engine.begin() as conn:
        await conn.run_sync(lambda c: command.downgrade(_alembic_config(c), "base"))
