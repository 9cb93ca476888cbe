"""`lorafarm.client` (sync and async) against a live registry, on SQLite and PostgreSQL: uploads with
tags, splits, promotion, rollback, versions, metrics, rollouts, typed errors carrying the registry's
message; and the CLI's alias and upload commands, which go through it."""

from __future__ import annotations

import asyncio

import pytest

from lorafarm.cli import main
from lorafarm.client import (
    AsyncLorafarmClient,
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    LorafarmClient,
    LorafarmError,
    NotFoundError,
    UnavailableError,
    VersionCounts,
    parse_duration,
)
from tests.registry.helpers import ADMIN_TOKEN, free_port, live_server, make_adapter, unique
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def url(make_settings):
    with live_server(make_settings(rollout_tick_s=0.1)) as u:
        yield u


@pytest.fixture
def folders(tmp_path, base_config, base_hash):
    return [make_adapter(tmp_path / f"v{i}", base_config, seed=500 + i, trained_on=base_hash) for i in range(3)]


def test_sync_client_upload_split_promote_rollback(url, folders):
    tenant = unique("cl")
    alias = f"{tenant}/support:prod"
    with LorafarmClient(url, ADMIN_TOKEN) as reg:
        assert reg.create_tenant(tenant)["api_key"].startswith("lf-")
        v1 = reg.upload_adapter(folders[0], tenant, alias=alias, tags={"run": "sft-1", "step": 10})
        assert v1["created"] and v1["alias"] == alias and v1["tags"] == {"run": "sft-1", "step": 10}
        v2 = reg.upload_adapter(folders[1], tenant, tags={"run": "sft-2", "eval_loss": 0.25})
        assert reg.get_adapter(v2["adapter_id"])["tags"]["eval_loss"] == 0.25
        again = reg.upload_adapter(folders[1], tenant)
        assert again["adapter_id"] == v2["adapter_id"] and not again["created"]

        a = reg.split_alias(alias, {v1["adapter_id"]: 90, v2["adapter_id"]: 10})
        assert a["adapter_id"] == v1["adapter_id"] and [t["weight"] for t in a["split"]] == [90.0, 10.0]
        roles = {v["adapter"]["adapter_id"]: (v["role"], v["weight"]) for v in reg.versions(alias)}
        assert roles == {v1["adapter_id"]: ("stable", 90.0), v2["adapter_id"]: ("canary", 10.0)}
        assert reg.versions(alias)[0]["adapter"]["version"] == 2  # newest first
        a = reg.promote_alias(alias)
        assert a["adapter_id"] == v2["adapter_id"] and a["previous_adapter_id"] == v1["adapter_id"]
        assert reg.rollback_alias(alias)["adapter_id"] == v1["adapter_id"]
        assert [e["action"] for e in reg.audit(alias)][:3] == ["alias.rollback", "alias.promote", "alias.split"]

        # errors carry the registry's message, status and code
        with pytest.raises(InvalidRequestError) as e:
            reg.split_alias(alias, [(v1["adapter_id"], 50), (v2["adapter_id"], 40)])
        assert e.value.status == 422 and e.value.code == "invalid_split" and "summing to 100" in e.value.message
        with pytest.raises(NotFoundError) as e:
            reg.get_alias(f"{tenant}/nosuch:prod")
        assert e.value.code == "alias_not_found" and "no alias" in str(e.value)
        with pytest.raises(ConflictError):
            reg.delete_adapter(v1["adapter_id"])
        with pytest.raises(LorafarmError) as e:
            reg.upload_adapter(folders[0].parent / "missing", tenant)
        assert e.value.status == 0
    with LorafarmClient(url, "wrong-token") as bad, pytest.raises(AuthenticationError):
        bad.list_tenants()
    with LorafarmClient(f"http://127.0.0.1:{free_port()}", ADMIN_TOKEN, timeout=2) as down:
        with pytest.raises(UnavailableError) as e:
            down.list_tenants()
        assert e.value.status == 0 and "unreachable" in e.value.message


async def test_async_client_rollout_and_metrics(url, folders):
    tenant = unique("ca")
    alias = f"{tenant}/a:prod"
    async with AsyncLorafarmClient(url, ADMIN_TOKEN) as reg:
        await reg.create_tenant(tenant)
        v1 = (await reg.upload_adapter(folders[0], tenant, alias=alias))["adapter_id"]
        v2 = (await reg.upload_adapter(folders[1], tenant))["adapter_id"]
        ro = await reg.start_rollout(alias, v2, steps=[20, 100], interval="200ms",
                                     bounds={"min_requests": 5, "min_ttft_samples": 5})
        assert ro["state"] == "running" and ro["percent"] == 20 and ro["interval_s"] == 0.2
        with pytest.raises(ConflictError) as e:
            await reg.start_rollout(alias, v2)
        assert e.value.code == "rollout_running"
        assert (await reg.get_alias(alias))["rollout_id"] == ro["rollout_id"]

        def window(aid, n, errors=0):
            c = VersionCounts(requests=n)
            for _ in range(errors):
                c.add_error("upstream_5xx")
            for _ in range(n - errors):
                c.add_ttft(0.02)
            return {"alias": alias, "adapter_id": aid, **c.to_wire()}

        async def push():
            await reg.push_version_stats(0.2, [window(v1, 20), window(v2, 5)], router_id="test")

        async def pushed_until_done():
            await push()
            return (await reg.get_rollout(ro["rollout_id"]))["state"] != "running"

        await wait_until(pushed_until_done, 20, interval=0.1,
                         what=f"rollout {ro['rollout_id']} no longer running")
        done = await reg.wait_rollout(ro["rollout_id"], timeout=10, poll_s=0.1)
        assert done["state"] == "promoted"
        m = await reg.alias_metrics(alias, window_s=60)
        assert m["versions"][v2]["requests"] >= 5 and m["versions"][v2]["error_rate"] == 0
        assert [r["rollout_id"] for r in await reg.list_rollouts(alias)] == [ro["rollout_id"]]
        # a rollout aborted by the client: all traffic back to the old version
        v3 = (await reg.upload_adapter(folders[2], tenant))["adapter_id"]
        ro = await reg.start_rollout(alias, v3, steps=(10, 50, 100), interval=60)
        aborted = await reg.abort_rollout(ro["rollout_id"])
        assert aborted["state"] == "aborted" and (await reg.get_alias(alias))["adapter_id"] == v2


def test_parse_duration():
    assert [parse_duration(x) for x in ("90", "90s", "500ms", "5m", "1h", 2)] == [90, 90, 0.5, 300, 3600, 2]
    for bad in ("", "m", "-1s", "soon", 0):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_registry_client_is_the_client():
    from lorafarm import registry_client

    assert registry_client.RegistryClient is AsyncLorafarmClient
    assert registry_client.RegistryError is LorafarmError


async def test_cli_alias_and_upload_commands(url, folders, monkeypatch, capsys):
    monkeypatch.setenv("LORAFARM_REGISTRY_URL", url)
    monkeypatch.setenv("LORAFARM_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("LORAFARM_ACTOR", "carol@ci")

    async def run(*argv):
        capsys.readouterr()
        code = await asyncio.to_thread(main, [str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out.strip(), out.err.strip()

    tenant = unique("cc")
    alias = f"{tenant}/a:prod"
    assert (await run("tenants", "create", tenant))[0] == 0
    code, v1, _ = await run("adapters", "upload", folders[0], "--tenant", tenant, "--alias", alias, "--tag", "run=r1",
                            "--tag", "step=40", "--tag", "eval_loss=0.5")
    assert code == 0
    with LorafarmClient(url, ADMIN_TOKEN) as reg:
        assert reg.get_adapter(v1)["tags"] == {"run": "r1", "step": 40, "eval_loss": 0.5}
    v2 = (await run("adapters", "upload", folders[1], "--tenant", tenant))[1]
    code, out, _ = await run("aliases", "split", alias, f"{v1}=75", f"{v2}=25")
    assert code == 0 and f"{v1} 75% / {v2} 25%" in out
    code, out, _ = await run("aliases", "versions", alias)
    assert code == 0 and f"v2\t{v2}\tcanary\t25%" in out and "run=r1" in out
    code, out, _ = await run("aliases", "promote", alias)
    assert code == 0 and out.startswith(f"{alias} -> {v2}")
    assert (await run("aliases", "rollback", alias))[0] == 0
    code, out, _ = await run("aliases", "rollout", alias, v2, "--steps", "10,50,100", "--interval", "5m",
                             "--min-requests", "30")
    assert code == 0 and "running at 10%" in out and "every 300 s" in out
    code, out, err = await run("aliases", "rollout", alias, v2)
    assert code == 2 and "already running" in err and "(HTTP 409)" in err
    code, out, _ = await run("aliases", "rollouts", alias)
    assert code == 0 and "running at 10%" in out
    code, out, _ = await run("aliases", "metrics", alias, "--step")
    assert code == 0 and out.startswith(alias)
    code, out, _ = await run("aliases", "rollout-abort", alias)
    assert code == 0 and "aborted at 0%" in out and "aborted by carol@ci" in out
    code, _, err = await run("aliases", "rollout-abort", alias)
    assert code == 2 and "no rollout is running" in err
    with LorafarmClient(url, ADMIN_TOKEN) as reg:
        assert reg.audit(alias, action="rollout.abort")[0]["actor"] == "carol@ci"
    with pytest.raises(SystemExit):
        main(["aliases", "split", alias, "not-a-target"])
