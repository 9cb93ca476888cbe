"""The fleet simulator: its CLI contract, and behaviours that follow from the real routing and
slot-policy code it runs (small fleets, seconds each)."""

from __future__ import annotations

import json

import pytest

from loadtests.autoscale import Hpa
from loadtests.simulate import HOT_ADAPTER, AutoscaleConfig, SimConfig, diurnal, simulate
from lorafarm.cli import main

SMALL = dict(replicas=4, adapters=400, rate=6.0, duration=150.0, warmup_s=30.0, slots=20, ram_adapters=60)


def test_cli_json_contract(capsys):
    assert main(["simulate", "--replicas", "2", "--adapters", "100", "--rate", "3", "--duration", "60",
                 "--slots", "10", "--routing", "random", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("p95_ttft_s", "p50_ttft_s", "device_hit_rate", "evictions_per_min", "replicas"):
        assert key in last
    assert last["replicas"] == 2 and last["requests"] > 50
    assert 0 <= last["device_hit_rate"] <= 1 and last["p50_ttft_s"] <= last["p95_ttft_s"]


def test_cli_bad_input_exit_2(capsys):
    assert main(["simulate", "--replicas", "0", "--json"]) == 2


def test_affinity_beats_random_and_never_evicts_in_use():
    """Fewer slots than adapters: affinity (warm first, rendezvous owners) keeps each adapter on few
    replicas, random routing spreads it over all of them and thrashes."""
    aff = simulate(SimConfig(**SMALL, routing="affinity"))
    rnd = simulate(SimConfig(**SMALL, routing="random"))
    assert aff.device_hit_rate > rnd.device_hit_rate + 0.1
    assert aff.evictions_per_min < rnd.evictions_per_min
    assert aff.evictions_in_use == 0 and rnd.evictions_in_use == 0
    assert aff.requests == rnd.requests  # the same seeded arrivals


def test_same_seed_same_answer_and_more_slots_more_hits():
    a = simulate(SimConfig(**SMALL))
    b = simulate(SimConfig(**SMALL))
    assert a.p95_ttft_s == b.p95_ttft_s and a.device_hit_rate == b.device_hit_rate
    more = simulate(SimConfig(**{**SMALL, "slots": 80}))
    assert more.device_hit_rate > a.device_hit_rate


def test_overload_raises_ttft():
    """Past the fleet's decode capacity (32 rows / 50 ms = 640 tok/s per replica) queues build up."""
    ok = simulate(SimConfig(**{**SMALL, "rate": 4.0}))
    over = simulate(SimConfig(**{**SMALL, "rate": 14.0}))  # 14 x 250 = 3,500 tok/s > 4 x 640
    assert over.p95_ttft_s > 3 * ok.p95_ttft_s


def test_hot_tenant_gets_more_owners():
    """The registry's rule raises the hot adapter's owner count from its traffic; routing then spreads it."""
    r = simulate(SimConfig(**{**SMALL, "replicas": 8, "hot_tokens_per_s": 1500.0}))
    assert r.hot is not None and r.hot["max_owners"] >= 4
    assert r.hot["replicas_used"] >= 4
    assert HOT_ADAPTER not in r.replica_requests  # (keys are replica ids)


def test_hpa_formula_tolerance_and_stabilisation():
    h = Hpa(min_replicas=1, max_replicas=50, scale_down_window_s=300)
    assert h.recommend(10, {"q": (4.0, 2.0)}) == 20  # ceil(10 x 4 / 2)
    assert h.recommend(10, {"q": (2.1, 2.0)}) == 10  # within the 10% tolerance
    assert h.recommend(10, {"q": (1.0, 2.0), "t": (3000, 1000)}) == 30  # max over metrics
    assert h.desired(0, 10, {"q": (8.0, 2.0)}) == 20  # 40 wanted; at most +max(4 pods, 100%) per period
    assert h.desired(15, 2, {"q": (8.0, 2.0)}) == 6  # from 2: +4 pods
    h2 = Hpa(min_replicas=1, max_replicas=50, scale_down_window_s=300)
    assert h2.desired(0, 10, {"q": (2.0, 2.0)}) == 10
    assert h2.desired(100, 10, {"q": (0.5, 2.0)}) == 10  # the window still holds 10
    assert h2.desired(401, 10, {"q": (0.5, 2.0)}) == 3  # 300 s later: ceil(10 x 0.25)


def test_autoscaler_follows_a_diurnal_curve():
    r = simulate(SimConfig(replicas=2, adapters=200, rate=12.0, duration=900.0, warmup_s=30.0, slots=40,
                           ram_adapters=100, rate_curve=diurnal(900.0, low=0.1),
                           autoscale=AutoscaleConfig(min_replicas=2, max_replicas=12, startup_s=5.0)))
    reps = r.series["replicas"]
    assert max(reps) > 2  # scaled up for the peak in the middle
    assert reps[-1] < max(reps)  # and back down after it


def test_trace_drives_arrivals_and_lengths(tmp_path, capsys):
    """A trace (Azure LLM format) sets the gaps (scaled to --rate) and the lengths."""
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{i * 0.5},{40 + i % 7},{5 + i % 3}" for i in range(50)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    assert main(["simulate", "--replicas", "2", "--adapters", "50", "--rate", "4", "--duration", "60",
                 "--slots", "10", "--warmup", "10", "--trace", str(tmp_path / "t.csv"), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 150 <= last["requests"] <= 250  # ~4 req/s over the 50 measured seconds (warm-up 10 s)
    assert last["output_tokens_per_s"] == pytest.approx(4 * 6, rel=0.25)  # generated tokens 5..7
    assert main(["simulate", "--trace", str(tmp_path / "missing.csv")]) == 2


def test_hpa_scale_up_window_takes_the_lowest_recent_recommendation():
    h = Hpa(min_replicas=1, max_replicas=50, scale_up_window_s=60)
    assert h.desired(0, 10, {"q": (2.0, 2.0)}) == 10
    assert h.desired(15, 10, {"q": (4.0, 2.0)}) == 10  # 20 wanted, but 10 was recommended 15 s ago
    assert h.desired(75, 10, {"q": (4.0, 2.0)}) == 20  # the low one left the window


# ------------------------------------------------------------------ fair share by tenant (issue 35)

# one replica (every tenant's requests meet in its batch), four victim tenants at ~5 rows of work
# together, and a hostile tenant sending n=16 x 600-token requests at 0.5/s: 240 rows of work wanted
# on 32 rows, a backlog that grows for the whole run
HOSTILE = dict(replicas=1, adapters=40, rate=2.0, duration=120.0, warmup_s=20.0, slots=50, ram_adapters=60,
               prompt_tokens=200.0, output_tokens=50.0, tenants=4, hostile_rate=0.5)


def test_the_engines_fairness_policy_bounds_the_victims_ttft_under_a_hostile_tenant():
    """The replica model admits to its batch with handler.engine.fairness.FairPolicy: fair, the
    victims' TTFT stays what it is without the attacker (a step or two) and every victim request
    finishes; fifo, the victims queue behind the attacker's backlog. The attacker keeps the rows the
    victims leave (work conservation)."""
    calm = simulate(SimConfig(**{**HOSTILE, "hostile_rate": 0.0}))
    fair = simulate(SimConfig(**HOSTILE, scheduling="fair"))
    fifo = simulate(SimConfig(**HOSTILE, scheduling="fifo"))
    base = calm.tenants["victims"]
    v_fair, v_fifo = fair.tenants["victims"], fifo.tenants["victims"]
    assert v_fair["unfinished"] == 0 and v_fair["rows"] == base["rows"]
    assert v_fair["p95_ttft_s"] <= 2 * base["p95_ttft_s"]
    assert v_fair["max_ttft_s"] < 1.0  # bounded: a few 50 ms steps, whatever the attacker's backlog
    assert fair.preemptions > 0  # the victims took rows from the attacker (share preemption)
    assert v_fifo["p95_ttft_s"] > 50 * v_fair["p95_ttft_s"] and v_fifo["unfinished"] > 0
    assert fifo.preemptions == 0
    hostile = fair.tenants["hostile"]["output_tokens_per_s"]
    assert hostile > 0.5 * fifo.tenants["hostile"]["output_tokens_per_s"]  # it still gets the idle rows


def test_without_tenants_fair_and_fifo_make_the_same_choices():
    """One anonymous tenant: the policy's guarantee (fair == fifo), so results without tenants are
    those of the simulator before the policy was wired in."""
    a = simulate(SimConfig(**SMALL, scheduling="fair"))
    b = simulate(SimConfig(**SMALL, scheduling="fifo"))
    assert a.tenants is None and a.preemptions == 0
    assert (a.p95_ttft_s, a.p50_ttft_s, a.requests, a.output_tokens_per_s) == \
        (b.p95_ttft_s, b.p50_ttft_s, b.requests, b.output_tokens_per_s)


def test_cli_tenants_and_hostile_tenant(capsys):
    assert main(["simulate", "--replicas", "1", "--adapters", "20", "--rate", "1", "--duration", "40",
                 "--warmup", "10", "--slots", "10", "--tenants", "2", "--hostile-rate", "0.2",
                 "--scheduling", "fair", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"t0", "t1", "hostile", "victims"} <= set(last["tenants"])
    assert last["tenants"]["victims"]["rows"] == last["tenants"]["t0"]["rows"] + last["tenants"]["t1"]["rows"]
    assert last["preemptions"] >= 0
    assert main(["simulate", "--hostile-rate", "1", "--hostile-n", "0", "--json"]) == 2
