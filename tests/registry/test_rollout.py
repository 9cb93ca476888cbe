"""Rollouts run by the registry (issue 38), on SQLite and PostgreSQL, with the routers' per-version
windows pushed by hand: step by step promotion, automatic rollback with its audit row and log line,
one rollout per alias, changes by hand, and a rollout that outlives the registry process."""

from __future__ import annotations

import logging
import time

import pytest

from lorafarm.client.summary import VersionCounts
from tests.registry.helpers import app_client, make_adapter, unique, upload_files
from tests.waiting import describe, wait_until

FAST = {"min_requests": 5, "min_ttft_samples": 5, "max_error_rate_increase": 0.05}


@pytest.fixture(scope="module")
async def fast(make_settings):
    """A registry app whose rollout driver ticks every 0.1 s."""
    async with app_client(make_settings(rollout_tick_s=0.1)) as c:
        yield c


async def _tenant_with_versions(client, base_config, base_hash, tmp_path, n: int = 2) -> tuple[str, str, list[str]]:
    tenant = unique("ro")
    assert (await client.post("/internal/tenants", json={"name": tenant})).status_code == 201
    alias = f"{tenant}/a:prod"
    ids = []
    for i in range(n):
        folder = make_adapter(tmp_path / f"v{i}", base_config, seed=200 + i + hash(tenant) % 1000, trained_on=base_hash)
        data = {"tenant_id": tenant, **({"alias": alias} if i == 0 else {})}
        r = await client.post("/internal/adapters/upload", data=data, files=upload_files(folder))
        assert r.status_code == 201, r.text
        ids.append(r.json()["adapter_id"])
    return tenant, alias, ids


def _window(alias: str, adapter_id: str, requests: int, errors: int = 0, ttft: float = 0.1) -> dict:
    c = VersionCounts(requests=requests, prompt_tokens=10 * requests, completion_tokens=5 * requests)
    for _ in range(errors):
        c.add_error("upstream_5xx")
    for _ in range(requests - errors):
        c.add_ttft(ttft)
    c.add_finish({"stop": requests - errors})
    return {"alias": alias, "adapter_id": adapter_id, **c.to_wire()}


async def _push(client, *rows) -> None:
    r = await client.post("/internal/stats/versions", json={"window_s": 0.5, "router_id": "test", "versions": list(rows)})
    assert r.status_code == 204, r.text


async def _until(client, rollout_id: int, pred, timeout: float = 15.0, push=None) -> dict:
    """The rollout once `pred` holds for it; `push` (the routers' next window) runs after each miss."""
    seen: list[dict] = []

    async def check():
        r = (await client.get(f"/internal/rollouts/{rollout_id}")).json()
        seen.append(r)
        if pred(r):
            return r
        if push is not None:
            await push()
        return None

    return await wait_until(check, timeout, interval=0.1, what=f"rollout {rollout_id}: {describe(pred)}",
                            logs=lambda: f"last rollout: {seen[-1] if seen else None}")


async def test_rollout_promotes_step_by_step(fast, base_config, base_hash, tmp_path):
    tenant, alias, (v1, v2) = await _tenant_with_versions(fast, base_config, base_hash, tmp_path)
    r = await fast.post("/internal/rollouts", json={"alias": alias, "adapter_id": v2, "steps": [10, 50, 100],
                                                    "interval_s": 0.5, "bounds": FAST})
    assert r.status_code == 201, r.text
    ro = r.json()
    assert ro["state"] == "running" and ro["percent"] == 10 and ro["old_adapter_id"] == v1
    assert ro["bounds"]["min_requests"] == 5 and ro["bounds"]["max_ttft_p95_ratio"] == 1.5  # defaults kept
    table = (await fast.get("/internal/routing")).json()  # read-your-writes: the split is there at once
    assert table["aliases"][alias]["split"] == [{"adapter_id": v1, "weight": 90.0}, {"adapter_id": v2, "weight": 10.0}]
    assert (await fast.get(f"/internal/aliases/{alias}")).json()["rollout_id"] == ro["rollout_id"]

    async def healthy():
        await _push(fast, _window(alias, v1, 20), _window(alias, v2, 3))

    ro = await _until(fast, ro["rollout_id"], lambda x: x["percent"] == 50, push=healthy)
    table = (await fast.get("/internal/routing")).json()
    assert table["aliases"][alias]["split"][1] == {"adapter_id": v2, "weight": 50.0}
    step = (await fast.get(f"/internal/aliases/{alias}/metrics", params={"rollout_step": "true"})).json()
    assert set(step["versions"]) <= {v1, v2}
    ro = await _until(fast, ro["rollout_id"], lambda x: x["state"] != "running", push=healthy)
    assert ro["state"] == "promoted" and ro["percent"] == 100 and ro["finished_at"]
    assert "promoted to 100%" in ro["reason"]
    a = (await fast.get(f"/internal/aliases/{alias}")).json()
    assert a["adapter_id"] == v2 and a["previous_adapter_id"] == v1 and a["split"] is None and a["rollout_id"] is None
    actions = [e["action"] for e in (await fast.get("/internal/audit", params={"target": alias})).json()]
    assert actions[:3] == ["rollout.promote", "rollout.step", "rollout.start"]


async def test_failing_version_rolled_back_within_the_step(fast, base_config, base_hash, tmp_path, caplog):
    tenant, alias, (v1, v2) = await _tenant_with_versions(fast, base_config, base_hash, tmp_path)
    r = await fast.post("/internal/rollouts", json={"alias": alias, "adapter_id": v2, "steps": [10, 100],
                                                    "interval_s": 60, "bounds": FAST})
    ro = r.json()
    caplog.set_level(logging.WARNING, logger="lorafarm.registry.rollout")
    started = time.monotonic()
    await _push(fast, _window(alias, v1, 60), _window(alias, v2, 6, errors=6))
    ro = await _until(fast, ro["rollout_id"], lambda x: x["state"] != "running")
    took = time.monotonic() - started
    assert ro["state"] == "rolled_back" and ro["breached"] == "error_rate" and took < 5  # not after the 60 s step
    assert "error_rate bound breached" in ro["reason"]
    a = (await fast.get(f"/internal/aliases/{alias}")).json()
    assert a["adapter_id"] == v1 and a["split"] is None
    row = (await fast.get("/internal/audit", params={"target": alias, "action": "rollout.rollback"})).json()[0]
    assert row["actor"].startswith(f"rollout {ro['rollout_id']}") and row["detail"]["breached"] == "error_rate"
    assert row["detail"]["rolled_back_adapter_id"] == v2 and row["detail"]["figures"]["new"]["errors"] == 6
    assert any("ROLLED BACK (bound breached: error_rate)" in m and alias in m for m in caplog.messages)
    table = (await fast.get("/internal/routing")).json()
    assert table["aliases"][alias].get("split") is None and table["aliases"][alias]["adapter_id"] == v1


async def test_slow_version_rolled_back_on_ttft(fast, base_config, base_hash, tmp_path):
    tenant, alias, (v1, v2) = await _tenant_with_versions(fast, base_config, base_hash, tmp_path)
    ro = (await fast.post("/internal/rollouts", json={"alias": alias, "adapter_id": v2, "steps": [50, 100],
                                                      "interval_s": 60, "bounds": FAST})).json()
    await _push(fast, _window(alias, v1, 30, ttft=0.1), _window(alias, v2, 30, ttft=0.9))
    ro = await _until(fast, ro["rollout_id"], lambda x: x["state"] != "running")
    assert ro["state"] == "rolled_back" and ro["breached"] == "ttft_p95"


async def test_one_rollout_per_alias_and_refusals(fast, base_config, base_hash, tmp_path):
    tenant, alias, (v1, v2, v3) = await _tenant_with_versions(fast, base_config, base_hash, tmp_path, 3)
    body = {"alias": alias, "adapter_id": v2, "steps": [10, 100], "interval_s": 60}
    ro = (await fast.post("/internal/rollouts", json=body)).json()
    r = await fast.post("/internal/rollouts", json={**body, "adapter_id": v3})
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_running"
    running = (await fast.get("/internal/rollouts", params={"alias": alias, "state": "running"})).json()
    assert [x["rollout_id"] for x in running] == [ro["rollout_id"]]
    r = await fast.post(f"/internal/rollouts/{ro['rollout_id']}/abort")
    assert r.status_code == 200 and r.json()["state"] == "aborted"
    a = (await fast.get(f"/internal/aliases/{alias}")).json()
    assert a["adapter_id"] == v1 and a["split"] is None
    assert (await fast.post(f"/internal/rollouts/{ro['rollout_id']}/abort")).status_code == 409
    refusals = [
        ({**body, "alias": f"{tenant}/none:prod"}, 404, "alias_not_found"),
        ({**body, "adapter_id": v1}, 422, "already_deployed"),
        ({**body, "steps": [50, 10, 100]}, 422, "invalid_rollout"),
        ({**body, "steps": [10, 50]}, 422, "invalid_rollout"),
        ({**body, "bounds": {"max_ttft_p95_ratio": 0.5}}, 400, "validation_error"),
        ({**body, "interval_s": 0}, 400, "validation_error"),
    ]
    for b, status, code in refusals:
        r = await fast.post("/internal/rollouts", json=b)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (b, r.text)
    await fast.put(f"/internal/aliases/{alias}/split",
                   json={"targets": [{"adapter_id": v1, "weight": 50}, {"adapter_id": v3, "weight": 50}]})
    r = await fast.post("/internal/rollouts", json=body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "alias_split"
    assert (await fast.get("/internal/rollouts/999999")).status_code == 404


@pytest.mark.parametrize("change, state", [
    ("set", "aborted"), ("rollback", "rolled_back"), ("promote", "promoted"), ("delete", "aborted"),
])
async def test_a_change_by_hand_ends_the_rollout(fast, base_config, base_hash, tmp_path, change, state):
    tenant, alias, (v1, v2) = await _tenant_with_versions(fast, base_config, base_hash, tmp_path)
    ro = (await fast.post("/internal/rollouts", json={"alias": alias, "adapter_id": v2, "steps": [10, 100],
                                                      "interval_s": 60})).json()
    if change == "set":
        await fast.put(f"/internal/aliases/{alias}", json={"adapter_id": v1})
    elif change == "rollback":
        await fast.post(f"/internal/aliases/{alias}/rollback")
    elif change == "promote":
        await fast.post(f"/internal/aliases/{alias}/promote")
    else:
        await fast.delete(f"/internal/aliases/{alias}")
    r = (await fast.get(f"/internal/rollouts/{ro['rollout_id']}")).json()
    assert r["state"] == state and "by hand" in r["reason"], r


async def test_rollout_outlives_the_registry_process(make_settings, base_config, base_hash, tmp_path):
    """State in the database: a rollout started through one registry process is finished by the next."""
    async with app_client(make_settings(rollout_tick_s=30)) as first:  # this one never ticks
        tenant, alias, (v1, v2) = await _tenant_with_versions(first, base_config, base_hash, tmp_path)
        ro = (await first.post("/internal/rollouts", json={"alias": alias, "adapter_id": v2, "steps": [10, 100],
                                                           "interval_s": 0.3, "bounds": FAST})).json()
    async with app_client(make_settings(rollout_tick_s=0.1)) as second:
        async def healthy():
            await _push(second, _window(alias, v1, 20), _window(alias, v2, 5))

        r = await _until(second, ro["rollout_id"], lambda x: x["state"] != "running", push=healthy)
        assert r["state"] == "promoted"
        assert (await second.get(f"/internal/aliases/{alias}")).json()["adapter_id"] == v2
