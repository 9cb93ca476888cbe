"""A tenant's fair-scheduling weight (issue 35): the registry's verify answer carries it, the router
forwards it to the replica with the tenant (x-lorafarm-tenant-weight), never to a foreign worker."""

from __future__ import annotations

import pytest

from router.auth import Tenant
from tests.router.conftest import router_farm

pytestmark = pytest.mark.timeout(60)

MSG = [{"role": "user", "content": "hello"}]


def test_verify_answer_carries_the_weight():
    body = {"tenant_id": "acme", "key_id": "k1", "requests_per_s": None, "tokens_per_s": None}
    assert Tenant.from_verify(body).weight is None  # a registry without weights: the replica's default, 1
    assert Tenant.from_verify({**body, "weight": 2.5}).weight == 2.5
    assert Tenant.from_verify({**body, "weight": None}).weight is None


async def test_router_forwards_tenant_and_weight_to_the_replica():
    async with router_farm() as farm:
        heavy = farm.registry.add_tenant("heavy")
        farm.registry.tenants[heavy]["weight"] = 3.0
        plain = farm.registry.add_tenant("plain")
        aids = {t: farm.registry.add_adapter(t, "support", "dev-a", alias=f"{t}/support:prod") for t in ("heavy", "plain")}
        await farm.sync()
        for key, tenant in ((heavy, "heavy"), (plain, "plain")):
            await farm.client(key).chat.completions.create(model=f"{tenant}/support:prod", messages=MSG)
        seen = {r["model"]: (r["tenant"], r["weight"]) for rep in farm.replicas.values() for r in rep.requests}
        assert seen[aids["heavy"]] == ("heavy", "3")
        assert seen[aids["plain"]] == ("plain", None)  # no weight: no header (the replica's default)


def test_foreign_workers_get_no_tenant_headers(monkeypatch):
    from router.workers import ForeignWorkers

    monkeypatch.setenv("A_KEY", "theirs")
    fw = ForeignWorkers()
    fw.apply([{"name": "a", "url": "http://h:1/", "kind": "openai", "api_key_env": "A_KEY", "weight": 1}])
    h = fw.headers_for("worker:a", {"authorization": "Bearer ADMIN", "x-lorafarm-tenant": "t",
                                    "x-lorafarm-tenant-weight": "3", "x-request-id": "r"})
    assert "ADMIN" not in str(h) and not any(k.startswith("x-lorafarm-tenant") for k in h) and h["x-request-id"] == "r"
