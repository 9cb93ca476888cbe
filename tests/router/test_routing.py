"""choose(): the pure routing function."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafarm.rendezvous import owners
from router.config import RouterSettings
from router.routing import STRATEGIES, ReplicaSnapshot, RouteRequest, ViewSnapshot, choose

H1, H2 = "sha256:aaa", "sha256:bbb"


def rep(rid, h=H1, gpu=(), ram=(), tokens=0, conns=0, weight=1.0, healthy=True, fresh=True, models=("dev-a",), queue=0):
    return ReplicaSnapshot(
        replica_id=rid, url=f"http://{rid}", base_model_hash=h, models=frozenset(models),
        capacity_weight=weight, gpu_adapters=frozenset(gpu), ram_adapters=frozenset(ram),
        tokens_in_flight=tokens, connections=conns, queue_depth=queue, healthy=healthy, state_fresh=fresh,
    )  # fmt: skip


def ids(ranked):
    return [r.replica_id for r in ranked]


def req(adapter="ad-x", h=H1, k=2):
    return RouteRequest(adapter_id=adapter, base_model_hash=h, owners_k=k)


def test_gpu_beats_ram_beats_owner_beats_any():
    names = [f"r{i}" for i in range(6)]
    own = owners("ad-x", names, 2)
    others = [n for n in names if n not in own]
    gpu_r, ram_r = others[0], others[1]
    view = [rep(n, gpu=("ad-x",) if n == gpu_r else (), ram=("ad-x",) if n == ram_r else ()) for n in names]
    ranked = choose(req(), view)
    assert ids(ranked)[:2] == [gpu_r, ram_r]
    assert set(ids(ranked)[2:4]) == set(own)
    assert [r.klass for r in ranked[:4]] == ["gpu", "ram", "owner", "owner"]
    assert [r.route_class for r in ranked] == ["warm", "warm", "owner", "owner", "cold", "cold"]


def test_least_tokens_orders_within_a_class():
    view = [rep("r0", gpu=("ad-x",), tokens=500), rep("r1", gpu=("ad-x",), tokens=100), rep("r2", gpu=("ad-x",), tokens=300)]
    assert ids(choose(req(), view))[:3] == ["r1", "r2", "r0"]


def test_least_connections_orders_within_a_class():
    view = [rep("r0", gpu=("ad-x",), conns=1, tokens=900), rep("r1", gpu=("ad-x",), conns=5, tokens=10)]
    assert ids(choose(req(), view, "least_connections")) == ["r0", "r1"]
    assert ids(choose(req(), view, "least_tokens")) == ["r1", "r0"]


def test_weighted_prefers_capacity():
    view = [rep("r0", gpu=("ad-x",), weight=1.0, tokens=100), rep("r1", gpu=("ad-x",), weight=4.0, tokens=300)]
    assert ids(choose(req(), view, "weighted"))[0] == "r1"  # 301/4 < 101/1
    idle = [rep("r0", gpu=("ad-x",), weight=1.0), rep("r1", gpu=("ad-x",), weight=2.0)]
    assert ids(choose(req(), idle, "weighted"))[0] == "r1"


def test_random_stays_inside_the_class_and_spreads():
    view = [rep("r0", gpu=("ad-x",)), rep("r1", gpu=("ad-x",)), rep("r2"), rep("r3")]
    rng = random.Random(1)
    firsts = {ids(choose(req(), view, "random", rng=rng))[0] for _ in range(50)}
    assert firsts == {"r0", "r1"}


def test_only_replicas_of_the_base_model():
    view = [rep("a0", H1, gpu=("ad-x",)), rep("b0", H2, gpu=("ad-x",), models=("dev-b",)), rep("a1", H1)]
    assert set(ids(choose(req(h=H1), view))) == {"a0", "a1"}
    assert ids(choose(req(h=H2), view)) == ["b0"]
    assert choose(req(h="sha256:none"), view) == []


def test_base_model_request_by_name():
    view = [rep("a0", H1, models=("dev-a",), tokens=50), rep("a1", H1, models=("dev-a",)), rep("b0", H2, models=("dev-b", "embed"))]
    r = choose(RouteRequest(model_name="dev-a", base_model_hash=H1), view)
    assert ids(r) == ["a1", "a0"] and all(x.route_class == "warm" for x in r)
    assert ids(choose(RouteRequest(model_name="embed"), view)) == ["b0"]


def test_unhealthy_is_skipped_but_possibly_warm_is_not():
    view = [
        rep("r0", gpu=("ad-x",), healthy=False),
        rep("r1", gpu=("ad-x",), fresh=False),  # state fetch failed: possibly warm
        rep("r2"),
    ]
    ranked = choose(req(), view)
    assert "r0" not in ids(ranked)
    assert ids(ranked)[0] == "r1" and ranked[0].klass == "gpu"


def test_all_unhealthy_is_a_last_resort_not_nothing():
    view = [rep("r0", healthy=False), rep("r1", healthy=False)]
    assert set(ids(choose(req(), view))) == {"r0", "r1"}


def test_overloaded_warm_replica_yields_to_an_owner_under_threshold():
    names = [f"r{i}" for i in range(5)]
    own = owners("ad-x", names, 2)
    warm = next(n for n in names if n not in own)
    view = ViewSnapshot(
        replicas=tuple(rep(n, gpu=("ad-x",) if n == warm else (), tokens=10_000 if n == warm else 0) for n in names),
        load_threshold_tokens=4096,
    )
    ranked = choose(req(), view)
    assert ids(ranked)[0] in own and ranked[0].route_class == "owner"
    assert ids(ranked)[-1] == warm  # still a failover candidate, the last


def test_spill_to_least_loaded_when_every_warm_and_owner_is_over():
    names = [f"r{i}" for i in range(5)]
    own = owners("ad-x", names, 2)
    others = [n for n in names if n not in own]
    load = {own[0]: 9000, own[1]: 9500, others[0]: 3000, others[1]: 200, others[2]: 800}
    view = ViewSnapshot(replicas=tuple(rep(n, tokens=load[n]) for n in names), load_threshold_tokens=4096)
    ranked = choose(req(), view)
    assert ids(ranked)[0] == others[1]
    assert ranked[0].route_class == "spill"
    assert set(ids(ranked)) == set(names)


def test_queue_depth_counts_as_overload():
    names = ["r0", "r1", "r2"]
    own = owners("ad-x", names, 1)
    view = ViewSnapshot(
        replicas=tuple(rep(n, queue=50 if n == own[0] else 0) for n in names), load_threshold_queue=16
    )
    ranked = choose(req(k=1), view)
    assert ranked[0].route_class == "spill" and ranked[0].replica_id != own[0]


def test_affinity_off_is_the_base_strategy():
    view = [rep("r0", gpu=("ad-x",), tokens=900), rep("r1", tokens=0)]
    ranked = choose(req(), view, affinity=False)
    assert ids(ranked) == ["r1", "r0"]
    assert {r.route_class for r in ranked} == {"cold"}


def test_owners_follow_k_and_move_when_an_owner_dies():
    names = [f"r{i}" for i in range(8)]
    own3 = owners("ad-x", names, 3)
    ranked = choose(req(k=3), [rep(n) for n in names])
    assert set(ids(ranked)[:3]) == set(own3)
    dead = own3[0]
    ranked = choose(req(k=3), [rep(n, healthy=n != dead) for n in names])
    assert set(ids(ranked)[:3]) == set(owners("ad-x", [n for n in names if n != dead], 3))


def test_deterministic_without_rng_and_unknown_strategy_rejected():
    view = [rep(f"r{i}") for i in range(6)]
    assert ids(choose(req(), view)) == ids(choose(req(), view))
    with pytest.raises(ValueError):
        choose(req(), view, "fastest")


def test_equal_replicas_are_not_always_resolved_the_same_way():
    view = [rep(f"r{i}", gpu=[f"ad-{j}" for j in range(50)]) for i in range(4)]
    firsts = {ids(choose(req(adapter=f"ad-{j}"), view))[0] for j in range(50)}
    assert len(firsts) >= 3


replica_st = st.builds(
    lambda i, h, gpu, ram, tokens, conns, healthy, fresh, w: rep(
        f"r{i}", h, gpu=gpu, ram=ram, tokens=tokens, conns=conns, healthy=healthy, fresh=fresh, weight=w
    ),
    st.integers(0, 30),
    st.sampled_from([H1, H2]),
    st.sets(st.sampled_from(["ad-x", "ad-y"]), max_size=2),
    st.sets(st.sampled_from(["ad-x", "ad-y"]), max_size=2),
    st.integers(0, 20_000),
    st.integers(0, 40),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.5, 1.0, 2.0]),
)


@settings(max_examples=300, deadline=None)
@given(
    replicas=st.lists(replica_st, max_size=12, unique_by=lambda r: r.replica_id),
    strategy=st.sampled_from(STRATEGIES),
    k=st.integers(1, 4),
    h=st.sampled_from([H1, H2]),
    seed=st.integers(0, 2**16),
)
def test_properties(replicas, strategy, k, h, seed):
    view = ViewSnapshot(replicas=tuple(replicas), load_threshold_tokens=8192)
    ranked = choose(req(h=h, k=k), view, strategy, rng=random.Random(seed))
    serving = [r for r in replicas if r.base_model_hash == h]
    healthy = [r for r in serving if r.healthy]
    # a permutation of the healthy serving replicas (or of all serving ones when none is healthy)
    assert sorted(ids(ranked)) == sorted(r.replica_id for r in (healthy or serving))
    if not ranked:
        return
    pool = healthy or serving
    warm_ok = [r for r in pool if ("ad-x" in r.gpu_adapters or "ad-x" in r.ram_adapters) and not view.overloaded(r)]
    own = set(owners("ad-x", {r.replica_id: r.capacity_weight for r in pool}, k))
    owner_ok = [r for r in pool if r.replica_id in own and not view.overloaded(r)]
    first = ranked[0]
    if any("ad-x" in r.gpu_adapters and not view.overloaded(r) for r in pool):
        assert first.klass == "gpu" and not first.overloaded
    elif warm_ok:
        assert first.klass == "ram"
    elif owner_ok:
        assert first.klass == "owner"
    else:
        # spill: the least loaded candidate (by tokens per capacity, replicas under threshold first)
        best = min((view.overloaded(r), r.tokens_in_flight / r.capacity_weight) for r in pool)
        assert (first.overloaded, first.replica.tokens_in_flight / first.replica.capacity_weight) == best


# ------------------------------------------------------------------ expected time to first token


def held(rid, tier, ms=None, queue=0, tokens=0, tier_ms=None):
    r = rep(rid, gpu=("ad-x",) if tier == "gpu" else (), ram=("ad-x",) if tier == "ram" else (), queue=queue,
            tokens=tokens)
    return ReplicaSnapshot(**{**r.__dict__, "disk_adapters": frozenset(["ad-x"]) if tier == "disk" else frozenset(),
                              "load_ms": {"ad-x": ms} if ms is not None else {}, "tier_load_ms": tier_ms or {}})


def test_expected_ttft_queue_wait_against_load_time():
    # a device copy behind 3 queued requests (300 ms) loses to an idle replica with a 20 ms RAM copy ...
    view = ViewSnapshot(replicas=(held("r0", "gpu", queue=3), held("r1", "ram", ms=20.0)))
    assert ids(choose(req(), view)) == ["r1", "r0"]
    # ... and wins when the RAM copy costs more than the queue
    view = ViewSnapshot(replicas=(held("r0", "gpu", queue=3), held("r1", "ram", ms=350.0)))
    assert ids(choose(req(), view)) == ["r0", "r1"]
    # the replica's own measured figures count: a slow disk loses to a fast one
    view = ViewSnapshot(replicas=(held("r0", "disk", ms=90.0), held("r1", "disk", ms=30.0)))
    assert ids(choose(req(), view))[0] == "r1"


def test_requests_waiting_for_other_adapters_loads_do_not_count_as_queue():
    """queue_depth also counts requests waiting for their own adapter's load; only the engine's batch
    queue (engine_waiting) delays a request whose adapter is already on the device there."""
    loading = dataclasses.replace(held("r0", "gpu", queue=3), engine_waiting=0)  # 3 waiting for loads
    view = ViewSnapshot(replicas=(loading, held("r1", "ram", ms=20.0)))
    assert ids(choose(req(), view)) == ["r0", "r1"]
    batch_full = dataclasses.replace(held("r0", "gpu", queue=3), engine_waiting=3)
    view = ViewSnapshot(replicas=(batch_full, held("r1", "ram", ms=20.0)))
    assert ids(choose(req(), view)) == ["r1", "r0"]
    assert loading.batch_queue() == 0 and held("r0", "gpu", queue=3).batch_queue() == 3  # not reported: all


def test_class_order_score_ranks_by_class_then_strategy():
    # expected-TTFT (the default): the idle RAM copy beats the device copy behind 3 queued requests
    busy_gpu = ViewSnapshot(replicas=(held("r0", "gpu", queue=3), held("r1", "ram", ms=20.0)))
    assert ViewSnapshot().score == RouterSettings().score == "expected-ttft"
    assert ids(choose(req(), busy_gpu)) == ["r1", "r0"]
    # class-order (the rule before issue 13): the device copy first, whatever its queue
    assert ids(choose(req(), dataclasses.replace(busy_gpu, score="class-order"))) == ["r0", "r1"]
    # within a class the strategy decides, not the expected load time
    two_ram = ViewSnapshot(replicas=(held("r0", "ram", ms=5.0, tokens=500), held("r1", "ram", ms=300.0, tokens=100)))
    assert ids(choose(req(), two_ram)) == ["r0", "r1"]
    assert ids(choose(req(), dataclasses.replace(two_ram, score="class-order"))) == ["r1", "r0"]
    with pytest.raises(ValueError, match="unknown score"):
        choose(req(), dataclasses.replace(two_ram, score="fastest"))
    with pytest.raises(ValueError, match="score must be one of"):
        RouterSettings(score="fastest")


def test_a_disk_copy_beats_an_owner_that_must_fetch():
    names = [f"r{i}" for i in range(4)]
    own = owners("ad-x", names, 1)
    other = next(n for n in names if n not in own)
    view = [held(n, "disk", ms=40.0) if n == other else rep(n) for n in names]
    ranked = choose(req(k=1), view)
    assert ids(ranked)[:2] == [other, own[0]]
    assert [r.klass for r in ranked[:2]] == ["disk", "owner"]
    # unless the owner reports remote loads faster than that disk (its moving average)
    view = [held(n, "disk", ms=40.0) if n == other else held(n, "none", tier_ms={"remote": 10.0}) for n in names]
    assert ids(choose(req(k=1), view))[0] == own[0]


def test_default_tier_figures_keep_the_class_order_with_empty_queues():
    names = [f"r{i}" for i in range(6)]
    own = owners("ad-x", names, 1)
    others = [n for n in names if n not in own]
    tiers = dict(zip(others, ["disk", "ram", "gpu", "none", "none"]))
    view = [held(n, tiers.get(n, "none")) for n in names]
    ranked = choose(req(k=1), view)
    assert [r.klass for r in ranked] == ["gpu", "ram", "disk", "owner", "any", "any"]


def test_equal_expected_ttft_is_broken_by_the_strategy():
    view = [held("r0", "ram", ms=10.0, tokens=500), held("r1", "ram", ms=10.0, tokens=100)]
    assert ids(choose(req(), view)) == ["r1", "r0"]
    view = [held("r0", "ram", ms=10.0, tokens=500), held("r1", "ram", ms=10.0, tokens=100)]
    firsts = {ids(choose(req(), view, "random", rng=random.Random(s)))[0] for s in range(40)}
    assert firsts == {"r0", "r1"}


def test_expected_ttft_keeps_possibly_warm_and_spill():
    # a stale state still counts its last known tiers
    stale = ReplicaSnapshot(**{**held("r0", "ram", ms=5.0).__dict__, "state_fresh": False})
    assert ids(choose(req(), [stale, held("r1", "disk", ms=40.0)]))[0] == "r0"
    # every holder and owner over its threshold: spill to the least loaded, whatever its load time
    names = ["r0", "r1", "r2", "r3"]
    own = owners("ad-x", names, 1)[0]
    free = [n for n in names if n != own]
    view = ViewSnapshot(replicas=(held(own, "gpu", tokens=9000), held(free[0], "ram", ms=1.0, tokens=9500),
                                  rep(free[1], tokens=100), rep(free[2], tokens=50)), load_threshold_tokens=4096)
    ranked = choose(req(k=1), view)
    assert ids(ranked)[0] == free[2] and ranked[0].route_class == "spill"


def test_merged_replica_serves_only_its_adapter():
    """Same base hash, but a merged-mode replica takes only requests for its merged adapter."""
    plain = ReplicaSnapshot("r0", base_model_hash="h", models=frozenset({"base"}))
    merged = ReplicaSnapshot("rm", base_model_hash="h", models=frozenset({"ad-1"}), only_adapter="ad-1",
                             gpu_adapters=frozenset({"ad-1"}))
    base = [r.replica_id for r in choose(RouteRequest(base_model_hash="h", model_name="base"), [plain, merged])]
    assert base == ["r0"]
    other = [r.replica_id for r in choose(RouteRequest(adapter_id="ad-2", base_model_hash="h"), [plain, merged])]
    assert other == ["r0"]
    own = [r.replica_id for r in choose(RouteRequest(adapter_id="ad-1", base_model_hash="h"), [plain, merged])]
    assert own[0] == "rm" and set(own) == {"r0", "rm"}
