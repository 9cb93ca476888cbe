"""The fairness policy (handler/engine/fairness.py), pure: counters, lift, weights, shares, work
conservation, n rows, the metrics ledger's bounded names. No model, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from handler.engine.fairness import (
    IDLE_KEEP,
    MAX_WEIGHT,
    QUEUE_BUCKETS,
    FairPolicy,
    TenantLedger,
    clamp_weight,
)


def arrive(p: FairPolicy, client, n: int = 1, weight: float = 1.0) -> None:
    for _ in range(n):
        p.arrive(client, weight)


def test_least_served_backlogged_client_first():
    p = FairPolicy(8)
    arrive(p, "a", 3)
    arrive(p, "b", 3)
    assert p.pick(["a", "b"]) == "a"  # a tie: the first given (the earlier head)
    p.admit("a")
    p.charge("a", prefill=10, decode=5)  # 10 * 1 + 5 * 2
    assert p.clients["a"].counter == 20.0
    assert p.pick(["a", "b"]) == "b"
    p.admit("b")
    p.charge("b", prefill=30)
    assert p.pick(["a", "b"]) == "a" and p.pick(["b"]) == "b" and p.pick([]) is None


def test_a_client_becoming_active_is_lifted_no_banked_idle_time():
    p = FairPolicy(8)
    arrive(p, "a", 2)
    p.admit("a")
    p.charge("a", decode=500)  # counter 1000
    arrive(p, "b")  # new: lifted to the least active counter, not 0
    assert p.clients["b"].counter == 1000.0
    # b leaves idle; a goes on; b comes back: lifted again to a's counter now
    p.leave("b", admitted=False)
    p.charge("a", decode=100)
    arrive(p, "b")
    assert p.clients["b"].counter == 1200.0
    # a client that pauses keeps a counter above the others' (it cannot shed it by pausing)
    p.admit("b")
    p.charge("b", decode=1000)  # 3200
    p.leave("b", admitted=True)
    assert p.idle["b"] == 3200.0
    arrive(p, "b")
    assert p.clients["b"].counter == 3200.0
    # with nobody active, a newcomer starts at the last least counter, not at 0
    p.leave("b", admitted=False)
    p.leave("a", admitted=False)
    p.leave("a", admitted=True)
    assert not p.clients
    arrive(p, "c")
    assert p.clients["c"].counter == 1200.0


def test_idle_counters_are_bounded():
    p = FairPolicy(4)
    arrive(p, "base")
    for i in range(IDLE_KEEP + 10):
        arrive(p, i)
        p.admit(i)
        p.charge(i, decode=i + 1)
        p.leave(i, admitted=True)
    assert len(p.idle) <= IDLE_KEEP


def test_weights_scale_the_counters_and_the_shares():
    p = FairPolicy(30)
    arrive(p, "big", 20, weight=2.0)
    arrive(p, "small", 20, weight=1.0)
    p.admit("big")
    p.admit("small")
    p.charge("big", decode=100)
    p.charge("small", decode=100)
    assert p.clients["big"].counter == 100.0 and p.clients["small"].counter == 200.0
    assert p.share("big") == 20.0 and p.share("small") == 10.0
    assert p.guaranteed("big") == 20 and p.guaranteed("small") == 10
    # the latest request's weight is the tenant's
    p.arrive("small", 2.0)
    assert p.share("small") == 15.0 and p.share("big") == 15.0
    assert clamp_weight(None) == 1.0 and clamp_weight("x") == 1.0 and clamp_weight(float("nan")) == 1.0
    assert clamp_weight(-3) == 1.0 and clamp_weight(0) == 1.0 and clamp_weight(1e9) == MAX_WEIGHT
    assert clamp_weight("2.5") == 2.5


def test_shares_below_and_over():
    p = FairPolicy(32)
    for c in ("a", "b", "c"):
        arrive(p, c, 20)
    assert abs(p.share("a") - 32 / 3) < 1e-9 and p.guaranteed("a") == 10
    for _ in range(30):
        p.admit("a")
    p.admit("b")
    p.admit("b")
    assert p.below_share("b") and p.below_share("c") and not p.below_share("a")
    assert p.most_over(["a", "b", "c"], strictly=True) == "a"
    assert p.most_over(["b", "c"], strictly=True) is None
    assert p.most_over(["b", "c"]) == "b"  # not strictly: the least below
    # sum of guarantees never exceeds the batch
    assert sum(p.guaranteed(c) for c in p.clients) <= 32
    # a client holding exactly its guarantee is not below it; holding its share is not over it
    q = FairPolicy(4)
    arrive(q, "x", 4)
    arrive(q, "y", 4)
    q.admit("x")
    q.admit("x")
    assert not q.below_share("x") and q.most_over(["x"], strictly=True) is None


def test_work_conserving_a_client_alone_gets_the_whole_batch():
    p = FairPolicy(16)
    arrive(p, "solo", 100)
    assert p.share("solo") == 16.0 and p.guaranteed("solo") == 16
    for _ in range(15):
        p.admit("solo")
    assert p.below_share("solo")  # it may take the last row too
    p.admit("solo")
    assert not p.below_share("solo") and p.most_over(["solo"], strictly=True) is None
    # an inactive client has no share and nothing is taken for it
    assert p.share("ghost") == 0.0 and not p.below_share("ghost")
    # a second client's arrival halves the share: the first is now over it
    arrive(p, "other")
    assert p.share("solo") == 8.0 and p.most_over(["solo"], strictly=True) == "solo"
    assert p.below_share("other")


def test_n_choices_count_as_n_rows():
    p = FairPolicy(32)
    arrive(p, "attacker", 4 * 16)  # four requests of n=16: 64 rows
    arrive(p, "victim", 1)
    for _ in range(32):
        p.admit("attacker")
    assert p.clients["attacker"].held == 32 and p.clients["attacker"].waiting == 32
    assert p.share("attacker") == 16.0 and p.over_share("attacker") == 16.0
    assert p.below_share("victim")
    p.requeue("attacker", "share")
    p.admit("victim")
    assert p.clients["attacker"].held == 31 and p.preemptions == {"kv": 0, "share": 1}
    assert {a.client for a in p.active()} == {"attacker", "victim"}


def test_active_report_and_waiting_clients():
    p = FairPolicy(8)
    arrive(p, "a", 2)
    arrive(p, "b", 1)
    p.admit("b")
    p.charge("b", prefill=4)
    rep = {a.client: a for a in p.active()}
    assert rep["a"].waiting == 2 and rep["b"].held == 1 and rep["b"].counter == 4.0
    assert rep["a"].share == 4.0 and rep["a"].guaranteed == 4
    assert p.waiting_clients() == 1
    assert p.active()[0].client == "a"  # least counter first


def test_ledger_names_at_most_n_and_every_total_is_monotonic():
    now = [0.0]
    led = TenantLedger(clock=lambda: now[0], named=2, half_life_s=10.0)
    led.served("a", 10, 5)
    led.served("b", 1, 1)
    led.served("c", 100, 0)  # no room: summed as "other"
    named, other = led.snapshot()
    # c served far more recently than b: c takes b's name, b's totals join "other"
    assert set(named) == {"a", "c"} and named["c"].prompt_tokens == 0
    assert other.prompt_tokens == 100 + 1 and other.generated_tokens == 1
    total = sum(u.prompt_tokens + u.generated_tokens for u in named.values()) + other.prompt_tokens + other.generated_tokens
    assert total == 10 + 5 + 1 + 1 + 100
    led.served("c", 7, 3)
    led.queued("c", 0.007)
    led.queued("c", 1e6)
    led.preempted("c", "share")
    named2, other2 = led.snapshot()
    assert named2["c"].prompt_tokens == 7 and named2["c"].preempted["share"] == 1
    assert named2["c"].queue_count == 2 and sum(named2["c"].queue_buckets) == 1  # 1e6 s is past the last bucket
    assert named2["c"].queue_buckets[QUEUE_BUCKETS.index(0.01)] == 1
    assert other2.prompt_tokens >= other.prompt_tokens
    # later: c is quiet, b busy again (served as "other"): b takes the name of the least served
    # recently (c), whose totals join "other"
    now[0] = 100.0
    led.served("a", 10, 0)
    led.served("b", 15, 0)
    named3, other3 = led.snapshot()
    assert set(named3) == {"a", "b"} and other3.prompt_tokens == other2.prompt_tokens + 7 + 15
    # hysteresis: c a little ahead of both named ones does not displace them (needs twice as much)
    now[0] = 300.0
    led.served("a", 10, 0)
    led.served("b", 10, 0)
    led.served("c", 15, 0)
    assert set(led.snapshot()[0]) == {"a", "b"}
    # no tenant id is a label the metrics reserve
    led2 = TenantLedger(named=0)
    led2.served(None, 3, 4)
    assert led2.snapshot()[0] == {} and led2.snapshot()[1].generated_tokens == 4


def test_fairness_imports_no_torch():
    """The simulator can run the policy: importing it pulls in no torch and nothing else of handler/."""
    code = "import sys, handler.engine.fairness; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'handler', 'transformers', 'numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "['handler', 'handler.engine', 'handler.engine.fairness']", out


def test_engine_config_scheduling_field_and_flag():
    import argparse

    from handler.engine.config import EngineConfig

    assert EngineConfig().scheduling == "fair"
    with pytest.raises(ValueError):
        EngineConfig(scheduling="lottery")
    with pytest.raises(ValueError):
        EngineConfig(fair_decode_weight=-1.0)
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args([])).scheduling == "fair"
    assert EngineConfig.from_args(parser.parse_args(["--scheduling", "fifo"])).scheduling == "fifo"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling", "lottery"])
