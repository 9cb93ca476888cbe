"""A tenant's fair-scheduling weight (issue 35): stored with its limits (nullable: 1), changed by
PATCH and `lorafarm tenants set-limits --weight`, carried by the key verification the routers use."""

from __future__ import annotations

from tests.registry.helpers import unique
from tests.registry.test_lifecycle import _refused, cli  # noqa: F401 - the fixture


async def test_weight_create_patch_verify(client):
    name = unique("wgt")
    created = await client.post("/internal/tenants", json={"name": name, "weight": 2.5})
    assert created.status_code == 201, created.text
    key = created.json()["api_key"]
    mine = next(t for t in (await client.get("/internal/tenants")).json() if t["tenant_id"] == name)
    assert mine["weight"] == 2.5
    assert (await client.post("/internal/auth/verify", json={"api_key": key})).json()["weight"] == 2.5
    r = await client.patch(f"/internal/tenants/{name}", json={"weight": 4})
    assert r.status_code == 200 and r.json()["weight"] == 4.0 and r.json()["requests_per_s"] is None
    r = await client.patch(f"/internal/tenants/{name}", json={"requests_per_s": 3})
    assert r.json()["weight"] == 4.0  # what is not sent is kept
    assert (await client.post("/internal/auth/verify", json={"api_key": key})).json()["weight"] == 4.0
    r = await client.patch(f"/internal/tenants/{name}", json={"weight": None})
    assert r.status_code == 200 and r.json()["weight"] is None  # back to the default, 1
    for bad in (0, -1, 2000, "x"):
        r = await client.patch(f"/internal/tenants/{name}", json={"weight": bad})
        assert r.status_code == 400, (bad, r.text)
    plain = unique("wgt")
    key = (await client.post("/internal/tenants", json={"name": plain})).json()["api_key"]
    assert (await client.post("/internal/auth/verify", json={"api_key": key})).json()["weight"] is None


async def test_set_limits_weight_cli(cli):  # noqa: F811 - the fixture
    tenant = unique("wcli")
    assert (await cli.run("tenants", "create", tenant))[0] == 0
    code, out, _ = await cli.run("tenants", "set-limits", tenant, "--weight", "3")
    assert code == 0 and "weight 3" in out and "requests_per_s unlimited" in out
    row = next(t for t in cli.http.get("/internal/tenants").json() if t["tenant_id"] == tenant)
    assert row["weight"] == 3.0
    code, out, _ = await cli.run("tenants", "set-limits", tenant, "--weight", "none")
    assert code == 0 and "weight 1" in out
    await _refused(cli, ["tenants", "set-limits", tenant, "--weight", "0"], "> 0")
    await _refused(cli, ["tenants", "set-limits", tenant, "--weight", "abc"], "not a number")
    rows = cli.audit(tenant)
    assert rows[0]["action"] == "tenant.set_limits" and rows[0]["detail"]["after"] == {"weight": None}
