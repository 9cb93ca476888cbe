"""End to end through a real uvicorn server and RegistryClient: upload a canary training dir ->
signed archive in the store (file and S3 backends) -> registered -> alias -> deploy another
version -> rollback restores the first; then what the router and replicas use."""

from __future__ import annotations

import asyncio

import pytest

from lorafarm.registry_client import RegistryClient, RegistryError
from tests.registry.helpers import ADMIN_TOKEN, BASE_NAME, live_server, unique


@pytest.fixture(params=["file", "s3"])
def store_settings(request, make_settings, registry_dir):
    if request.param == "file":
        return make_settings(store_url=(registry_dir / "e2e-store").as_uri())
    s3_endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return make_settings(store_url=f"s3://{bucket}/lorafarm", s3_endpoint_url=s3_endpoint)


async def test_upload_alias_deploy_rollback(store_settings, canaries, tmp_path, base_hash):
    from archives.keys import load_public_keys
    from archives.store import open_store
    from archives.verify import verify_archive

    tenant = unique("acme")
    alias = f"{tenant}/support:prod"
    with live_server(store_settings) as url:
        async with RegistryClient(url, ADMIN_TOKEN) as reg:
            created = await reg.create_tenant(tenant, requests_per_s=5, tokens_per_s=1000)
            assert created["tenant_id"] == tenant and created["api_key"].startswith("lf-")
            ok = await reg.verify_api_key(created["api_key"])
            assert ok == {"tenant_id": tenant, "key_id": created["key_id"], "requests_per_s": 5.0, "tokens_per_s": 1000.0,
                          "weight": None}

            first = await reg.upload_adapter(canaries / "c0000", tenant, alias=alias)
            assert first["adapter_id"].startswith("ad-") and first["alias"] == alias and first["created"]
            assert first["base_model_hash"] == base_hash and first["rank"] == 8 and first["version"] == 1

            # The signed archive is in the configured store, where weights_uri says.
            store = open_store(store_settings.store_url, endpoint_url=store_settings.s3_endpoint_url)
            try:
                key = store.key_for(first["weights_uri"])
                assert key and await store.exists(key)
                assert first["weights_uri"].startswith(store_settings.store_url)
            finally:
                await store.close()

            # Registered, and downloadable for replicas; the archive verifies with the registry's key.
            assert (await reg.get_adapter(first["adapter_id"]))["checksum"] == first["checksum"]
            lar = await reg.download_archive(first["adapter_id"], tmp_path / "first.lar")
            trust = load_public_keys([store_settings.signing_key.parent / "public.pem"])
            manifest = verify_archive(lar, trust, base_model_hash=base_hash, max_rank=64)
            assert (manifest.adapter_id, manifest.tenant_id, manifest.rank) == (first["adapter_id"], tenant, 8)

            # Re-uploading the same files is idempotent.
            again = await reg.upload_adapter(canaries / "c0000", tenant)
            assert again["adapter_id"] == first["adapter_id"] and again["created"] is False

            # Deploy another version, then roll back.
            second = await reg.upload_adapter(canaries / "c0001", tenant, base_model=BASE_NAME)
            assert second["version"] == 2 and second["adapter_id"] != first["adapter_id"]
            deployed = await reg.set_alias(alias, second["adapter_id"])
            assert deployed["adapter_id"] == second["adapter_id"]
            assert deployed["previous_adapter_id"] == first["adapter_id"]
            table, etag = await reg.routing_table()
            assert table["aliases"][alias] == {"adapter_id": second["adapter_id"], "tenant_id": tenant}

            rolled = await reg.rollback_alias(alias)
            assert rolled["adapter_id"] == first["adapter_id"]
            assert rolled["previous_adapter_id"] == second["adapter_id"]
            assert (await reg.get_alias(alias))["adapter_id"] == first["adapter_id"]
            unchanged, etag2 = await reg.routing_table(etag)
            assert unchanged is None or unchanged["aliases"][alias]["adapter_id"] == first["adapter_id"]
            table, etag3 = await reg.routing_table()
            assert etag3 != etag and table["aliases"][alias]["adapter_id"] == first["adapter_id"]
            assert table["base_models"][BASE_NAME] == base_hash

            listed = await reg.list_adapters(tenant)
            assert {a["adapter_id"] for a in listed} == {first["adapter_id"], second["adapter_id"]}
            assert [a["alias"] for a in await reg.list_aliases(tenant)] == [alias]


async def test_router_and_replica_calls(make_settings, canaries, base_hash):
    """What the router (verify, routing, stats) and replicas (join, heartbeat, placements) call."""
    from lorafarm.schemas import ReplicaState

    tenant = unique("rt")
    with live_server(make_settings()) as url:
        async with RegistryClient(url, ADMIN_TOKEN) as reg:
            t = await reg.create_tenant(tenant)
            adapter = await reg.upload_adapter(canaries / "c0002", tenant, alias=f"{tenant}/chat:prod")
            replicas = [f"{tenant}-r{i}" for i in range(3)]
            for i, rid in enumerate(replicas):
                joined = await reg.join_replica(rid, f"http://127.0.0.1:{8200 + i}", base_hash, [BASE_NAME])
                assert joined["status"] == "up"
            state = ReplicaState(replica_id=replicas[0], base_model_hash=base_hash, models=[BASE_NAME],
                                 gpu_adapters=[adapter["adapter_id"]])
            beat = await reg.heartbeat(replicas[0], state)
            assert beat["replica_id"] == replicas[0]
            await reg.heartbeat(replicas[1])

            placed = await reg.placement(adapter["adapter_id"])
            assert placed["k"] == 2 and len(placed["owners"]) == 2 and set(placed["owners"]) <= set(replicas)
            for rid in replicas:
                mine = (await reg.placements_for_replica(rid))["adapters"]
                assert (adapter["adapter_id"] in mine) == (rid in placed["owners"])

            await reg.push_stats(5.0, [{"adapter_id": adapter["adapter_id"], "requests": 3, "tokens": 300, "gpu_hits": 2}])
            table, etag = await reg.routing_table()
            assert {r["replica_id"] for r in table["replicas"]} >= set(replicas)
            assert table["adapters"][adapter["adapter_id"]]["owners_k"] == 2
            assert table["rank_limit"] == 64
            assert await reg.routing_table(etag) == (None, etag)

            key = await reg.create_key(tenant)
            assert (await reg.verify_api_key(key["api_key"]))["key_id"] == key["key_id"]
            await reg.revoke_key(tenant, key["key_id"])
            assert await reg.verify_api_key(key["api_key"]) is None
            assert (await reg.verify_api_key(t["api_key"]))["tenant_id"] == tenant
            keys = await reg.list_keys(tenant)
            assert {k["key_id"] for k in keys} == {t["key_id"], key["key_id"]}
            assert all("api_key" not in k for k in keys)

        async with RegistryClient(url, "wrong-token") as bad:
            with pytest.raises(RegistryError) as e:
                await bad.verify_api_key(t["api_key"])
            assert e.value.status == 401
    with pytest.raises(RegistryError) as e:  # server gone: status 0, a message
        async with RegistryClient(url, ADMIN_TOKEN, timeout=2) as reg:
            await reg.list_tenants()
    assert e.value.status == 0


async def test_cli_against_live_registry(make_settings, canaries, tmp_path, monkeypatch, capsys):
    """`lorafarm tenants create`, `adapters upload`, `aliases set|rollback` with URL/token from
    flags, environment and farm.json."""
    import json

    from lorafarm.cli import main

    tenant = unique("cli")
    alias = f"{tenant}/bot:prod"
    with live_server(make_settings()) as url:
        def run(*argv):
            return asyncio.to_thread(main, list(argv))

        monkeypatch.delenv("LORAFARM_REGISTRY_URL", raising=False)
        monkeypatch.delenv("LORAFARM_ADMIN_TOKEN", raising=False)
        assert await run("tenants", "create", tenant, "--registry-url", url, "--admin-token", ADMIN_TOKEN) == 0
        api_key = capsys.readouterr().out.strip()
        assert api_key.startswith("lf-")

        monkeypatch.setenv("LORAFARM_REGISTRY_URL", url)
        monkeypatch.setenv("LORAFARM_ADMIN_TOKEN", ADMIN_TOKEN)
        assert await run("adapters", "upload", str(canaries / "c0003"), "--tenant", tenant, "--alias", alias) == 0
        first = capsys.readouterr().out.strip()
        assert first.startswith("ad-") and len(first) == 23

        monkeypatch.delenv("LORAFARM_REGISTRY_URL")
        monkeypatch.delenv("LORAFARM_ADMIN_TOKEN")
        farm = tmp_path / "farm.json"
        farm.write_text(json.dumps({"registry_url": url, "admin_token": ADMIN_TOKEN}))
        monkeypatch.setenv("LORAFARM_FARM_JSON", str(farm))
        assert await run("adapters", "upload", str(canaries / "c0004"), "--tenant", tenant) == 0
        second = capsys.readouterr().out.strip()
        assert await run("aliases", "set", alias, second) == 0
        assert second in capsys.readouterr().out
        assert await run("aliases", "rollback", alias) == 0
        assert capsys.readouterr().out.startswith(f"{alias} -> {first}")

        # Errors are one line and exit 2.
        assert await run("aliases", "set", f"other/{alias.split('/')[1]}", second) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("lorafarm aliases: error:") and "\n" not in err
        assert await run("tenants", "create", tenant) == 2
        assert "already exists" in capsys.readouterr().err
        assert await run("adapters", "upload", str(tmp_path / "missing"), "--tenant", tenant) == 2
        capsys.readouterr()
