"""The pure slot policy (handler/adapters/slots.py) alone: no torch, no I/O, simulated time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from handler.adapters.slots import Plan, SlotPolicy


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> None:
        self.t += dt


def policy(pools=None, ram=1000, disk=2000):
    clock = Clock()
    return SlotPolicy(pools or {8: 2, 16: 1}, ram_bytes=ram, disk_bytes=disk, clock=clock), clock


def load(p: SlotPolicy, aid: str, rank: int = 8, size: int = 100) -> Plan:
    plan = p.acquire(aid, rank, size)
    assert plan.action == "load"
    p.on_loaded(plan)
    return plan


def test_importing_the_policy_pulls_in_no_torch():
    code = "import sys, handler.adapters.slots; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pool_for_picks_the_smallest_fitting_pool():
    p, _ = policy({8: 2, 16: 0, 32: 1})
    assert p.pool_for(4) == 8 and p.pool_for(8) == 8
    assert p.pool_for(16) == 32  # the rank-16 pool has no slots
    with pytest.raises(ValueError):
        p.pool_for(64)


def test_acquire_hit_load_join_and_tier_reporting():
    p, clock = policy()
    plan = p.acquire("a", 8, 100)
    assert (plan.action, plan.tier, plan.pool, plan.victim) == ("load", "remote", 8, None)
    assert p.is_loading("a") and p.free_slots(8) == 1  # the slot is reserved while it loads
    assert p.acquire("a", 8, 100).action == "join"  # single flight
    p.on_loaded(plan)
    assert p.tier_of("a") == "gpu" and p.refcount("a") == 1
    assert p.resident("ram") == ["a"] and p.resident("disk") == ["a"]
    again = p.acquire("a", 8, 100, retry=True)  # the joined request, after the load
    assert again.action == "hit" and p.refcount("a") == 2
    assert p.acquire("a", 8).tier == "gpu"
    c = p.counters
    assert c.slot_misses == 2 and c.slot_hits == 1 and c.loads == {"ram": 0, "disk": 0, "remote": 1}


def test_lru_victim_is_the_least_recently_used_idle_adapter_of_its_pool():
    p, clock = policy()
    for aid in ("a", "b"):
        load(p, aid)
        clock.tick()
    load(p, "x", rank=16)  # other pool: never a victim for rank 8
    p.release("x")
    p.release("b")
    clock.tick()
    p.release("a")  # a idle later than b -> b is the LRU
    plan = p.acquire("c", 8, 100)
    assert plan.action == "load" and plan.victim == "b"
    assert p.tier_of("b") == "ram"  # demoted to RAM, not to nothing
    p.on_loaded(plan)
    clock.tick()
    p.release("c")
    assert p.lru_idle(8) == "a"
    clock.tick()
    p.touch("a")  # touching a makes c the LRU idle one
    assert p.lru_idle(8) == "c"
    assert p.counters.evictions == 1 and p.counters.evictions_in_use == 0
    assert [e[1:] for e in p.counters.eviction_log] == [("b", 0)]


def test_in_use_and_held_adapters_are_never_evicted_and_a_full_pool_waits():
    p, clock = policy({8: 1})
    load(p, "a")
    plan = p.acquire("b", 8, 100)
    assert plan.action == "wait" and p.counters.slot_waits == 1
    assert p.acquire("b", 8, 100, retry=True).action == "wait" and p.counters.slot_waits == 1
    p.hold("a")
    assert p.release("a") is True  # idle, but held (a reference is about to be taken / draining)
    assert p.acquire("b", 8, 100, retry=True).action == "wait"
    p.unhold("a")
    plan = p.acquire("b", 8, 100, retry=True)
    assert plan.victim == "a"
    assert p.counters.evictions_in_use == 0
    assert p.release("a") is False  # no reference: nothing changes


def test_evictions_in_use_is_counted_when_forced_and_undo_uncounts():
    p, _ = policy({8: 1})
    load(p, "a")
    s = p.evict("a")
    assert p.counters.evictions_in_use == 1 and p.counters.evictions == 1
    p.undo_evict(s)
    assert p.counters.evictions_in_use == 0 and p.counters.evictions == 0 and p.refcount("a") == 1
    assert p.counters.eviction_log == []


def test_mount_steps_reserve_then_mount_or_cancel():
    p, _ = policy({8: 1})
    assert p.plan_mount("a", 8) == ("free", None)
    assert p.plan_mount("b", 8) == ("wait", None)  # reserved for a
    p.cancel_mount("a")
    assert p.plan_mount("b", 8) == ("free", None)
    p.on_mounted("b", 8)
    assert p.refcount("b") == 0 and p.plan_mount("c", 8) == ("evict", "b")


def test_failed_load_frees_the_reservation_and_counts_an_error():
    p, _ = policy({8: 1})
    plan = p.acquire("bad", 8, 100)
    p.on_loaded(plan, ok=False)
    assert p.counters.load_errors == 1 and p.tier_of("bad") == "remote" and p.free_slots(8) == 1


def test_ram_and_disk_are_byte_bounded_lru():
    p, _ = policy(ram=250, disk=300)
    assert p.put("ram", "a", 100) == [] and p.put("ram", "b", 100) == []
    p.touch("a", "ram")  # b is now the LRU
    assert p.put("ram", "c", 100) == ["b"] and p.used_bytes("ram") == 200
    assert p.put("ram", "huge", 251) is None and p.tier_of("huge") == "remote"
    assert p.counters.ram_evictions == 1
    p.put("disk", "a", 100)
    p.put("disk", "b", 100)
    p.pin_disk("a")  # being read: skipped
    assert p.put("disk", "c", 150) == ["b"] and p.resident("disk") == ["a", "c"]
    p.unpin_disk("a")
    assert p.put("disk", "d", 100) == ["a"] and p.counters.disk_evictions == 2
    assert p.drop("disk", "d") == 100 and p.used_bytes("disk") == 150
    assert p.counters.disk_evictions == 2  # drop is not an eviction


def test_on_loaded_reports_ram_and_disk_victims():
    p, _ = policy({8: 4}, ram=250, disk=250)
    load(p, "a")
    load(p, "b")
    plan = p.acquire("c", 8, 100)
    out = p.on_loaded(plan)
    assert out == {"ram": ["a"], "disk": ["a"]}
    assert p.tier_of("a") == "gpu"  # still mounted: the device copy stays


def test_trace_driven_by_simulated_time_keeps_refcounts():
    """A small discrete-event trace: 200 requests over 6 adapters on 2 slots; refcounts never go
    negative, nothing in use is evicted, every request is finally served."""
    import random

    rng = random.Random(7)
    p, clock = policy({8: 2}, ram=400, disk=10_000)
    running: list[tuple[float, str]] = []
    loading: dict[str, tuple[float, Plan]] = {}
    waiting: list[str] = []
    served = 0
    for i in range(200):
        clock.tick(0.1)
        for t, aid in sorted(running):
            if t <= clock.t:
                running.remove((t, aid))
                p.release(aid)
        for aid, (t, plan) in list(loading.items()):
            if t <= clock.t:
                del loading[aid]
                p.on_loaded(plan)
                running.append((clock.t + rng.random(), aid))
                served += 1
        for aid in list(waiting) + [f"ad{rng.randrange(6)}"]:
            retry = aid in waiting
            if retry:
                waiting.remove(aid)
            plan = p.acquire(aid, 8, 100, retry=retry)
            if plan.action == "hit":
                running.append((clock.t + rng.random(), aid))
                served += 1
            elif plan.action == "load":
                loading[aid] = (clock.t + {"ram": 0.01, "disk": 0.04, "remote": 0.4}[plan.tier], plan)
            else:  # wait / join: ask again next tick
                waiting.append(aid)
        assert all(p.refcount(a) >= 0 for a in p.resident("gpu"))
        assert len(p.resident("gpu")) + sum(1 for _ in loading) <= 2
    assert p.counters.evictions_in_use == 0
    assert p.counters.evictions > 0 and served > 100


def test_ram_keeps_the_copies_of_mounted_adapters_longest_and_demotes_to_ram():
    p, clock = policy({8: 1}, ram=250)
    load(p, "m")  # mounted, its RAM copy is the oldest entry
    p.release("m")
    assert p.put("ram", "x", 100) == []
    assert p.put("ram", "y", 100) == ["x"]  # x goes first although m is older: m is on the device
    plan = p.acquire("z", 8, 100)  # takes m's slot
    assert plan.victim == "m" and p.tier_of("m") == "ram"  # demoted to RAM, not to nothing


def test_popularity_is_a_decayed_request_count():
    p, clock = policy()
    p.popularity_half_life_s = 10.0
    for _ in range(4):
        p.note_request("old")
    clock.tick(30.0)  # 4 requests three half-lives ago weigh 0.5
    p.note_request("new")
    assert p.popular(2) == ["new", "old"] and p.popular(0) == []
    p.acquire("old", 8, 1)  # acquire counts too
    assert p.popular(1) == ["old"]
