"""The simulator's prefix cache (issue 24): the pure policy alone, then small fleets with it on and off."""

from __future__ import annotations

import math

import pytest

from loadtests.simulate import PrefixCachePolicy, SimConfig, simulate
from lorafarm.cli import main


def test_a_cached_prefix_serves_its_whole_blocks_and_counts_prompt_tokens():
    p = PrefixCachePolicy(capacity_tokens=1000, block_tokens=16)
    assert p.lookup("a", prompt_tokens=120, prefix_tokens=100) == 0  # first request: a miss
    assert p.insert("a", 100)  # its prefill done: 6 whole blocks kept (96 tokens)
    assert p.lookup("a", 130, 100) == 96  # the next request of the adapter prefills 34 tokens, not 130
    assert p.lookup("b", 130, 100) == 0  # another adapter (customer) never hits a's prefix
    assert p.lookup(None, 50) == 0  # a request without a system prompt
    assert (p.queries, p.hits) == (120 + 130 + 130 + 50, 96)
    assert p.insert("c", 15) is False and "c" not in p.entries  # no whole block: nothing to keep


def test_off_means_no_hits_and_nothing_kept():
    p = PrefixCachePolicy(capacity_tokens=1000, enabled=False)
    assert p.insert("a", 100) is False
    assert p.lookup("a", 120, 100) == 0
    assert p.entries == {} and p.hits == 0 and p.queries == 120


def test_lru_eviction_by_tokens_and_never_a_referenced_prefix():
    p = PrefixCachePolicy(capacity_tokens=64, block_tokens=16)
    for key in "abcd":
        p.insert(key, 16)
    p.lookup("a", 16, 16)  # a is now the most recent: b is the least
    p.pin("b")  # a running request holds b's blocks
    assert p.insert("e", 32)  # needs two entries' room: c and d go, b (referenced) and a (recent) stay
    assert list(p.entries) == ["b", "a", "e"] and p.used_tokens == 64 and p.evictions == 2
    p.pin("a")
    p.pin("e")
    assert p.insert("f", 16) is False  # everything referenced: f is not kept, nothing evicted
    assert list(p.entries) == ["b", "a", "e"] and p.evictions == 2
    p.unpin("b")
    assert p.insert("f", 16) and "b" not in p.entries
    assert p.insert("g", 80) is False  # larger than the whole cache
    assert p.used_tokens == sum(p.entries.values()) <= p.capacity_tokens


FLEET = dict(replicas=2, adapters=100, rate=2.0, duration=150.0, warmup_s=30.0, slots=40, ram_adapters=100,
             system_prompt_share=0.8, system_prompt_tokens=800.0)  # fmt: skip


def test_hits_cut_prefill_and_ttft_off_has_no_hits():
    on = simulate(SimConfig(**FLEET))
    off = simulate(SimConfig(**FLEET, prefix_cache=False))
    assert on.requests == off.requests  # the same seeded arrivals
    assert off.prefix_hit_rate == 0 and off.prefix_request_hit_rate == 0
    assert 0.2 < on.prefix_hit_rate < 0.8 and on.prefix_request_hit_rate > 0.5
    assert on.p50_ttft_s < 0.85 * off.p50_ttft_s and on.p95_ttft_s < off.p95_ttft_s  # 800-token prefills skipped


def test_a_small_cache_evicts_and_hits_less():
    full = simulate(SimConfig(**FLEET))
    small = simulate(SimConfig(**FLEET, prefix_cache_tokens=2000))  # about two system prompts per replica
    assert small.prefix_evictions > 0 and full.prefix_evictions == 0
    assert small.prefix_hit_rate < full.prefix_hit_rate / 2


def test_without_system_prompts_the_cache_changes_nothing():
    plain = dict(FLEET, system_prompt_share=0.0)
    a, b = simulate(SimConfig(**plain)), simulate(SimConfig(**plain, prefix_cache=False))
    assert (a.p50_ttft_s, a.p95_ttft_s, a.requests) == (b.p50_ttft_s, b.p95_ttft_s, b.requests)
    assert a.prefix_hit_rate == 0 and math.isnan(a.prefix_request_hit_rate)


def test_cli_flags_reach_the_simulation(capsys):
    import json

    argv = ["simulate", "--replicas", "2", "--adapters", "100", "--rate", "2", "--duration", "90", "--warmup", "20",
            "--slots", "40", "--system-prompt-share", "0.8", "--system-prompt-tokens", "800", "--json"]  # fmt: skip
    assert main(argv) == 0
    on = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--no-prefix-cache"]) == 0
    off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert on["prefix_hit_rate"] > 0.2 and off["prefix_hit_rate"] == 0
    assert main([*argv[:-1], "--prefix-cache-tokens", "0"]) == 0
    assert "prefix hit 0.0% of prompt tokens" in capsys.readouterr().out
    assert main(["simulate", "--system-prompt-share", "1.5", "--json"]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("key", ["system_prompt_share", "prefix_cache_tokens"])
def test_prefix_options_are_sweepable(key, capsys):
    values = "0,0.8" if key == "system_prompt_share" else "0,32000"
    argv = ["simulate", "--replicas", "2", "--adapters", "50", "--rate", "1", "--duration", "60", "--warmup", "10",
            "--slots", "20", "--system-prompt-share", "0.8", "--sweep", f"{key}={values}", "--json"]  # fmt: skip
    assert main(argv) == 0
    import json

    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs[0]["prefix_hit_rate"] == 0 and runs[1]["prefix_hit_rate"] > 0
