"""Alias traffic splits in the registry (issue 38), on SQLite and PostgreSQL: split, promote,
rollback, what the routing table shows, audit rows, and the refusals."""

from __future__ import annotations

import pytest

from tests.registry.helpers import make_adapter, unique, upload_files


@pytest.fixture(scope="module")
async def versions(client, base_config, base_hash, tmp_path_factory):
    """A tenant with three adapter versions (v1 aliased as <tenant>/a:prod) -> (tenant, [ids])."""
    tenant = unique("sp")
    assert (await client.post("/internal/tenants", json={"name": tenant})).status_code == 201
    ids = []
    for i in range(3):
        folder = make_adapter(tmp_path_factory.mktemp(f"v{i}"), base_config, seed=100 + i, trained_on=base_hash)
        data = {"tenant_id": tenant, "tags": '{"run": "r%d", "step": %d, "eval_loss": 1.5}' % (i, 10 * i)}
        if i == 0:
            data["alias"] = f"{tenant}/a:prod"
        r = await client.post("/internal/adapters/upload", data=data, files=upload_files(folder))
        assert r.status_code == 201, r.text
        ids.append(r.json()["adapter_id"])
    return tenant, ids


async def test_tags_kept_with_the_version(client, versions):
    tenant, (v1, *_) = versions
    a = (await client.get(f"/internal/adapters/{v1}")).json()
    assert a["tags"] == {"run": "r0", "step": 0, "eval_loss": 1.5}
    audit = (await client.get("/internal/audit", params={"target": v1})).json()
    assert audit[0]["action"] == "adapter.upload" and audit[0]["detail"]["tags"]["run"] == "r0"


@pytest.mark.parametrize("tags, words", [
    ("[1, 2]", "JSON object"), ("{nope", "not valid JSON"), ('{"a": {"b": 1}}', "values are"),
    ('{"a": "' + "x" * 300 + '"}', "256"), ('{"": 1}', "1 to 64"),
])
async def test_bad_tags_refused(client, versions, base_config, base_hash, tmp_path, tags, words):
    tenant, _ = versions
    folder = make_adapter(tmp_path / "t", base_config, seed=999, trained_on=base_hash)
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "tags": tags},
                          files=upload_files(folder))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags" and words in r.json()["error"]["message"]


async def test_split_promote_rollback(client, versions):
    tenant, (v1, v2, v3) = versions
    alias = f"{tenant}/a:prod"
    r = await client.put(f"/internal/aliases/{alias}/split",
                         json={"targets": [{"adapter_id": v1, "weight": 90}, {"adapter_id": v2, "weight": 10}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["adapter_id"] == v1 and out["split"] == [{"adapter_id": v1, "weight": 90.0},
                                                        {"adapter_id": v2, "weight": 10.0}]
    table = (await client.get("/internal/routing")).json()
    assert table["aliases"][alias]["split"] == out["split"] and table["aliases"][alias]["adapter_id"] == v1
    assert not table["adapters"][v2]["retired"]  # a split target is in use
    # the same split again is not a change
    before = (await client.get("/health")).json()["version"]
    await client.put(f"/internal/aliases/{alias}/split",
                     json={"targets": [{"adapter_id": v1, "weight": 90}, {"adapter_id": v2, "weight": 10}]})
    assert (await client.get("/health")).json()["version"] == before
    # a version in a split cannot be deleted
    r = await client.delete(f"/internal/adapters/{v2}")
    assert r.status_code == 409 and "splits traffic to it" in r.json()["error"]["message"]

    # rollback of a split: all traffic back to the stable version; the previous one untouched
    r = await client.post(f"/internal/aliases/{alias}/rollback")
    assert r.status_code == 200 and r.json()["split"] is None and r.json()["adapter_id"] == v1
    audit = (await client.get("/internal/audit", params={"target": alias})).json()
    assert audit[0]["action"] == "alias.rollback" and audit[0]["detail"]["dropped_split"][1]["adapter_id"] == v2
    assert any(a["action"] == "alias.split" and a["detail"]["split"][1]["weight"] == 10.0 for a in audit)

    # promote without naming: the split's other version; the stable one becomes previous
    await client.put(f"/internal/aliases/{alias}/split",
                     json={"targets": [{"adapter_id": v1, "weight": 50}, {"adapter_id": v3, "weight": 50}]})
    r = await client.post(f"/internal/aliases/{alias}/promote")
    assert r.status_code == 200, r.text
    assert r.json()["adapter_id"] == v3 and r.json()["previous_adapter_id"] == v1 and r.json()["split"] is None
    # no split, no name: nothing to promote
    r = await client.post(f"/internal/aliases/{alias}/promote", json={})
    assert r.status_code == 422 and r.json()["error"]["code"] == "promote_ambiguous"
    r = await client.post(f"/internal/aliases/{alias}/promote", json={"adapter_id": v2})
    assert r.status_code == 200 and r.json()["adapter_id"] == v2 and r.json()["previous_adapter_id"] == v3
    # three-way split: the stable version stays the current one when it is in the split
    r = await client.put(f"/internal/aliases/{alias}/split", json={"targets": [
        {"adapter_id": v1, "weight": 60}, {"adapter_id": v2, "weight": 30}, {"adapter_id": v3, "weight": 10}]})
    assert r.json()["adapter_id"] == v2 and len(r.json()["split"]) == 3
    # PUT (deploy one version) ends the split
    r = await client.put(f"/internal/aliases/{alias}", json={"adapter_id": v2})
    assert r.json()["split"] is None
    audit = (await client.get("/internal/audit", params={"target": alias, "action": "alias.set"})).json()
    assert audit[0]["detail"]["previous_split"][0]["adapter_id"] == v1


async def test_split_on_a_new_alias_and_refusals(client, versions):
    tenant, (v1, v2, v3) = versions
    alias = f"{tenant}/fresh:prod"
    r = await client.put(f"/internal/aliases/{alias}/split",
                         json={"targets": [{"adapter_id": v1, "weight": 25}, {"adapter_id": v2, "weight": 75}]})
    assert r.status_code == 200 and r.json()["adapter_id"] == v2  # the heaviest is the stable one
    refusals = [
        ({"targets": [{"adapter_id": v1, "weight": 50}, {"adapter_id": v2, "weight": 40}]}, "summing to 100"),
        ({"targets": [{"adapter_id": v1, "weight": 50}, {"adapter_id": v1, "weight": 50}]}, "each version once"),
        ({"targets": [{"adapter_id": "ad-" + "0" * 20, "weight": 50}, {"adapter_id": v1, "weight": 50}]},
         "no adapter"),
    ]
    for body, words in refusals:
        r = await client.put(f"/internal/aliases/{alias}/split", json=body)
        assert r.status_code == 422 and words in r.json()["error"]["message"], r.text
    for body in ({"targets": [{"adapter_id": v1, "weight": 100}]}, {"targets": [{"adapter_id": v1, "weight": -1},
                                                                                {"adapter_id": v2, "weight": 101}]}):
        assert (await client.put(f"/internal/aliases/{alias}/split", json=body)).status_code == 400
    # another tenant's version is refused
    other = unique("sp")
    await client.post("/internal/tenants", json={"name": other})
    r = await client.put(f"/internal/aliases/{other}/x:prod/split",
                         json={"targets": [{"adapter_id": v1, "weight": 50}, {"adapter_id": v2, "weight": 50}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "alias_not_owned"
    # a disabled version cannot receive traffic
    await client.post(f"/internal/adapters/{v3}/disable")
    try:
        r = await client.put(f"/internal/aliases/{alias}/split",
                             json={"targets": [{"adapter_id": v1, "weight": 50}, {"adapter_id": v3, "weight": 50}]})
        assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_disabled"
    finally:
        await client.post(f"/internal/adapters/{v3}/enable")
    listed = {a["alias"]: a for a in (await client.get("/internal/aliases", params={"tenant_id": tenant})).json()}
    assert listed[alias]["split"][1] == {"adapter_id": v2, "weight": 75.0}


async def test_version_stats_intake_and_alias_metrics(client, versions):
    tenant, (v1, v2, _) = versions
    alias = f"{tenant}/m:prod"
    await client.put(f"/internal/aliases/{alias}/split",
                     json={"targets": [{"adapter_id": v1, "weight": 80}, {"adapter_id": v2, "weight": 20}]})
    from lorafarm.client.summary import VersionCounts

    a, b = VersionCounts(requests=10, prompt_tokens=50, completion_tokens=40), VersionCounts(requests=4, cancels=1)
    for _ in range(10):
        a.add_ttft(0.1)
    a.add_finish({"stop": 9, "length": 1})
    b.add_error("upstream_5xx")
    rows = [{"alias": alias, "adapter_id": v1, **a.to_wire()}, {"alias": alias, "adapter_id": v2, **b.to_wire()}]
    for _ in range(2):  # two routers' windows add up
        r = await client.post("/internal/stats/versions", json={"window_s": 1.0, "router_id": "r-x", "versions": rows})
        assert r.status_code == 204, r.text
    m = (await client.get(f"/internal/aliases/{alias}/metrics", params={"window_s": 60})).json()
    s1, s2 = m["versions"][v1], m["versions"][v2]
    assert s1["requests"] == 20 and s1["error_rate"] == 0 and s1["finish_reasons"] == {"length": 2, "stop": 18}
    assert 0.09 < s1["ttft_p95_s"] < 0.116 and s1["completion_tokens"] == 80
    assert s2["requests"] == 8 and s2["errors"] == 2 and s2["error_kinds"] == {"upstream_5xx": 2}
    assert s2["error_rate"] == pytest.approx(2 / 6) and s2["cancel_rate"] == 0.25
    r = await client.get(f"/internal/aliases/{alias}/metrics", params={"rollout_step": "true"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"
    r = await client.post("/internal/stats/versions", json={"window_s": 1, "versions": [{"alias": alias,
                                                                                          "adapter_id": v1, "requests": -1}]})
    assert r.status_code == 400
