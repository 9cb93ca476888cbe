"""Rendezvous placement: stable owners, ~1/N movement when a replica joins, owner counts that
follow traffic (up with stats, back down when the adapter cools)."""

from __future__ import annotations

import hashlib


from registry import placement
from tests.registry.helpers import app_client, unique, upload_files
from tests.waiting import wait_until

ADAPTERS = [f"ad-{hashlib.sha256(str(i).encode()).hexdigest()[:20]}" for i in range(5000)]


def test_adding_27th_replica_moves_about_one_in_27(record_property):
    """26 -> 27 replicas, 5,000 adapters, k = 2: only placements that go to the new replica move."""
    from lorafarm.rendezvous import owners

    old = [f"r{i}" for i in range(26)]
    new = old + ["r26"]
    moved_placements = moved_adapters = 0
    for a in ADAPTERS:
        before, after = owners(a, old, 2), owners(a, new, 2)
        lost = set(before) - set(after)
        gained = set(after) - set(before)
        assert gained <= {"r26"} and len(lost) == len(gained)  # stable: nothing else moves
        moved_placements += len(lost)
        moved_adapters += bool(lost)
    placement_fraction = moved_placements / (2 * len(ADAPTERS))
    adapter_fraction = moved_adapters / len(ADAPTERS)
    record_property("moved_placement_fraction", round(placement_fraction, 4))
    record_property("moved_adapter_fraction", round(adapter_fraction, 4))
    print(f"\n26 -> 27 replicas over 5000 adapters (k=2): {placement_fraction:.4f} of owner placements moved "
          f"(ideal 1/27 = {1 / 27:.4f}); {adapter_fraction:.4f} of adapters changed one owner (ideal 2/27 = {2 / 27:.4f})")
    assert abs(placement_fraction - 1 / 27) < 0.01
    # The new replica takes about an equal share: 2 x 5000 / 27 placements.
    assert abs(moved_placements - 2 * 5000 / 27) < 0.15 * 2 * 5000 / 27


def test_owners_are_deterministic_and_spread():
    from lorafarm.rendezvous import owners

    replicas = [f"r{i}" for i in range(26)]
    load = dict.fromkeys(replicas, 0)
    for a in ADAPTERS:
        o = owners(a, replicas, 2)
        assert o == owners(a, list(reversed(replicas)), 2) and len(set(o)) == 2
        for r in o:
            load[r] += 1
    mean = 2 * len(ADAPTERS) / 26  # the seed's 385 adapters per replica
    assert max(load.values()) < 1.25 * mean and min(load.values()) > 0.75 * mean


def test_owner_count_policy():
    kw = dict(k_min=2, capacity=640.0, cooldown_ratio=0.8)
    assert placement.owner_count(0, 2, **kw) == 2
    assert placement.owner_count(1280, 2, **kw) == 2  # exactly 2 x capacity: enough
    assert placement.owner_count(1281, 2, **kw) == 3
    assert placement.owner_count(2000, 2, **kw) == 4  # the seed's hot customer: at least 4 replicas
    assert placement.owner_count(1900, 4, **kw) == 4  # hysteresis: 1900 > 0.8 x 3 x 640
    assert placement.owner_count(1000, 4, **kw) == 2  # ceil(1000 / 512) = 2
    assert placement.owner_count(0, 5, **kw) == 2
    s = [{"replica_id": f"r{i}", "status": "up", "base_model_hash": "h", "capacity_weight": 1.0} for i in range(3)]

    class R:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    cands = placement.eligible([R(**r) for r in s] + [R(replica_id="x", status="down", base_model_hash="h",
                                                       capacity_weight=1.0)], "h")
    assert sorted(cands) == ["r0", "r1", "r2"]
    assert len(placement.owners_for("ad-" + "0" * 20, 9, cands)) == 3  # capped by the replicas


async def test_hot_adapter_owner_count_rises_and_falls(make_settings, canaries, base_hash):
    """Stats showing 30,000 tokens/s raise k to ceil(30000 / 640) = 47 (capped by 4 replicas in the
    placement); once traffic stops the estimate decays and k falls back to 2. (At 30,000 tokens/s
    and tau 2 s, k stays 4 for 5.5 s after the post: a busy machine's slow requests still see it.)"""
    tau = 2.0
    async with app_client(make_settings(stats_tau_s=tau, sweep_interval_s=0.2)) as c:
        tenant = unique("hot")
        assert (await c.post("/internal/tenants", json={"name": tenant})).status_code == 201
        r = await c.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=upload_files(canaries / "c0008"))
        hot = r.json()["adapter_id"]
        r = await c.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=upload_files(canaries / "c0009"))
        cold = r.json()["adapter_id"]
        replicas = [f"{tenant}-r{i}" for i in range(4)]
        for i, rid in enumerate(replicas):
            r = await c.post("/internal/replicas/join", json={"replica_id": rid, "url": f"http://127.0.0.1:{9000 + i}",
                                                              "base_model_hash": base_hash, "models": ["m"]})
            assert r.status_code == 200

        async def owners(adapter_id):
            return (await c.get(f"/internal/placements/{adapter_id}")).json()

        before = await owners(hot)
        assert before["k"] == 2
        etag = (await c.get("/internal/routing")).headers["etag"]

        # One window of tau seconds at 30,000 tokens/s (the estimate adds tokens / tau).
        r = await c.post("/internal/stats", json={"window_s": tau, "adapters": [
            {"adapter_id": hot, "requests": 300, "tokens": 60000, "gpu_hits": 300},
            {"adapter_id": cold, "requests": 1, "tokens": 100, "gpu_hits": 0},
            {"adapter_id": "ad-unknown", "requests": 1, "tokens": 10, "gpu_hits": 0},
        ]})
        assert r.status_code == 204
        hot_now = await owners(hot)
        assert hot_now["k"] == 4 and set(before["owners"]) <= set(hot_now["owners"])  # old owners stay owners
        assert (await owners(cold))["k"] == 2
        table = await c.get("/internal/routing", headers={"If-None-Match": etag})
        assert table.status_code == 200 and table.headers["etag"] != etag
        assert table.json()["adapters"][hot]["owners_k"] == 4  # 47 wanted, 4 replicas
        for rid in hot_now["owners"]:
            assert hot in (await c.get("/internal/placements", params={"replica_id": rid})).json()["adapters"]

        # Traffic stops: the sweeper lowers k again within a few tau.
        async def cooled():
            return (await owners(hot))["k"] == 2
        await wait_until(cooled, 60, interval=0.3, what="owner count fallen back to 2")
        assert (await owners(hot))["owners"] == before["owners"]
