"""The router's side of alias traffic splits (issue 38): the pure version choice, resolution in the
catalog, per-version metrics, and a router (with the test doubles of tests/router) serving a split
alias sticky per `user`, with the metrics and the summary endpoint."""

from __future__ import annotations

import math
import random

import httpx
import pytest

from lorafarm.client.summary import VersionCounts
from router.catalog import Catalog
from router.metrics import CANCELLED, ERROR, OK, RouterMetrics
from router.proxy import UsageScanner
from router.routing import pick_version
from router.view import ReplicaView

OLD, NEW, OTHER = "ad-" + "1" * 20, "ad-" + "2" * 20, "ad-" + "3" * 20
USERS = [f"user-{i}" for i in range(4000)]


def _share(split, users=USERS, alias="t/a:p") -> float:
    return sum(pick_version(alias, split, u) == NEW for u in users) / len(users)


def test_pick_version_weights_stickiness_and_growth():
    # 4000 fixed users at 10%: the share is deterministic; within the binomial 99.9% interval
    # (z = 3.29: 0.1 +- 3.29 x sqrt(0.09 / 4000) = 0.1 +- 0.0156)
    share = _share([(OLD, 90), (NEW, 10)])
    assert abs(share - 0.10) < 3.29 * math.sqrt(0.09 / len(USERS))
    # sticky: the same user, the same version, every time
    assert all(pick_version("t/a:p", [(OLD, 90), (NEW, 10)], u) == pick_version("t/a:p", [(OLD, 90), (NEW, 10)], u)
               for u in USERS[:200])
    # growth only moves users to the grown version: every user on NEW at 10% is on it at 50% and 90%
    at = {w: {u for u in USERS if pick_version("t/a:p", [(OLD, 100 - w), (NEW, w)], u) == NEW} for w in (10, 50, 90)}
    assert at[10] <= at[50] <= at[90] and abs(len(at[50]) / len(USERS) - 0.5) < 0.03
    # order of the split does not matter; another alias draws independently
    assert _share([(NEW, 10), (OLD, 90)]) == share
    assert _share([(OLD, 90), (NEW, 10)], alias="t/b:p") != share
    # no user: drawn per request, still only versions of the split
    rng = random.Random(7)
    picks = [pick_version("t/a:p", [(OLD, 90), (NEW, 10)], None, rng) for _ in range(4000)]
    assert set(picks) <= {OLD, NEW} and 0.08 < picks.count(NEW) / 4000 < 0.12
    three = {pick_version("t/a:p", [(OLD, 50), (NEW, 30), (OTHER, 20)], u) for u in USERS}
    assert three == {OLD, NEW, OTHER}
    with pytest.raises(ValueError):
        pick_version("t/a:p", [])


def _view(split=None, new_status="active") -> ReplicaView:
    view = ReplicaView()
    alias = {"adapter_id": OLD, "tenant_id": "acme"}
    if split is not None:
        alias["split"] = split
    view.apply_table({
        "version": 3, "aliases": {"acme/a:prod": alias},
        "adapters": {OLD: {"tenant_id": "acme", "base_model_hash": "sha256:x", "owners_k": 2, "status": "active"},
                     NEW: {"tenant_id": "acme", "base_model_hash": "sha256:x", "owners_k": 2, "status": new_status}},
        "base_models": {"base": "sha256:x"}, "replicas": [],
    })
    return view


def test_catalog_resolves_a_split_alias():
    cat = Catalog(_view([{"adapter_id": OLD, "weight": 90}, {"adapter_id": NEW, "weight": 10}]))
    got = {u: cat.resolve("acme", "acme/a:prod", u) for u in USERS[:1000]}
    assert {r.adapter_id for r in got.values()} == {OLD, NEW}
    assert all(r.split and r.alias == "acme/a:prod" and r.upstream_model == r.adapter_id for r in got.values())
    assert all(cat.resolve("acme", "acme/a:prod", u).adapter_id == r.adapter_id for u, r in got.items())
    # listed once, under its stable version
    entry = cat.model_for("acme", "acme/a:prod")
    assert entry["root"] == OLD
    # by id: no split involved
    assert not cat.resolve("acme", NEW).split
    # a version of the split disabled since: never chosen
    cat = Catalog(_view([{"adapter_id": OLD, "weight": 10}, {"adapter_id": NEW, "weight": 90}], new_status="disabled"))
    assert {cat.resolve("acme", "acme/a:prod", u).adapter_id for u in USERS[:300]} == {OLD}
    # no split: the alias's adapter, not flagged
    cat = Catalog(_view())
    r = cat.resolve("acme", "acme/a:prod", "someone")
    assert r.adapter_id == OLD and not r.split


def test_version_metrics_summary_push_and_exposition():
    m = RouterMetrics()
    v = m.versions
    for i in range(10):
        v.record("acme/a:prod", NEW, OK, ttft=0.05, prompt_tokens=7, completion_tokens=3, finish_reasons={"stop": 1})
    v.record("acme/a:prod", NEW, ERROR, kind="upstream_5xx")
    v.record("acme/a:prod", NEW, CANCELLED)
    v.record("acme/a:prod", OLD, OK)
    s = {(r["alias"], r["version"]): r for r in v.summary()["versions"]}
    new = s[("acme/a:prod", NEW)]
    assert new["requests"] == 12 and new["errors"] == 1 and new["cancels"] == 1
    assert new["error_rate"] == pytest.approx(1 / 11) and new["finish_reasons"] == {"stop": 10}
    assert 0.045 < new["ttft_p95_s"] < 0.06 and new["completion_tokens"] == 30
    text = m.render().decode()
    assert f'lorafarm_router_version_requests_total{{alias="acme/a:prod",outcome="ok",version="{NEW}"}} 10.0' in text
    assert f'lorafarm_router_version_errors_total{{alias="acme/a:prod",kind="upstream_5xx",version="{NEW}"}}' in text
    assert "lorafarm_router_version_time_to_first_token_seconds_bucket" in text
    assert f'lorafarm_router_version_finish_reasons_total{{alias="acme/a:prod",reason="stop",version="{NEW}"}}' in text
    assert "lorafarm_router_version_client_cancels_total" in text

    import asyncio

    sent = []

    async def failing(w, rows):
        raise RuntimeError("registry down")

    async def ok(w, rows):
        sent.append(rows)

    with pytest.raises(RuntimeError):
        asyncio.run(v.push(failing))
    assert asyncio.run(v.push(ok)) == 2  # kept for the next push
    rows = {r["adapter_id"]: VersionCounts.from_wire(r) for r in sent[0]}
    assert rows[NEW].requests == 12 and rows[NEW].error_kinds == {"upstream_5xx": 1}
    assert asyncio.run(v.push(ok)) == 0  # nothing new


def test_usage_scanner_counts_finish_reasons():
    sc = UsageScanner()
    sc.feed_events(b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
                   b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n')
    assert sc.finish_reasons == {"length": 1}
    sc = UsageScanner()
    sc.feed_json(b'{"choices":[{"message":{"content":"say \\"finish_reason\\":\\"x\\""},"finish_reason":"stop"},'
                 b'{"finish_reason": "stop"}]}')
    assert sc.finish_reasons == {"stop": 2}


async def test_router_serves_a_split_alias_sticky_per_user():
    from tests.router.conftest import router_farm
    from tests.router.doubles import ADMIN_TOKEN

    async with router_farm() as farm:
        key = farm.registry.add_tenant("acme")
        old = farm.registry.add_adapter("acme", "v1", "dev-a", alias="acme/a:prod")
        new = farm.registry.add_adapter("acme", "v2", "dev-a")
        other = farm.registry.add_adapter("acme", "v3", "dev-a")
        farm.registry.aliases["acme/a:prod"]["split"] = [{"adapter_id": old, "weight": 80},
                                                         {"adapter_id": new, "weight": 20}]
        farm.registry.version += 1
        await farm.sync()
        seen: dict[str, set[str]] = {}
        async with httpx.AsyncClient(base_url=farm.url, headers={"Authorization": f"Bearer {key}"}) as http:
            for i in range(120):
                user = f"u{i % 40}"
                body = {"model": "acme/a:prod", "messages": [{"role": "user", "content": "hi"}], "stream": i % 2 == 0}
                headers = {}
                if i % 3 == 0:
                    headers["x-lorafarm-user"] = user
                else:
                    body["user"] = user
                r = await http.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200
                seen.setdefault(user, set()).add(r.headers["x-adapter-id"])
            assert all(len(v) == 1 for v in seen.values())  # sticky: one version per user
            versions = set().union(*seen.values())
            assert versions <= {old, new} and other not in versions
            summary = (await http.get("/internal/versions", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).json()
            assert (await http.get("/internal/versions", headers={"Authorization": "Bearer nope"})).status_code == 401
            metrics = (await http.get("/metrics")).text
        rows = {r["version"]: r for r in summary["versions"]}
        assert sum(r["requests"] for r in rows.values()) == 120 and set(rows) == versions
        assert all(r["errors"] == 0 for r in rows.values()) and sum(r["ttft_count"] for r in rows.values()) == 60
        assert 'lorafarm_router_version_requests_total{alias="acme/a:prod"' in metrics
