from collections import Counter

import pytest

from loadtests.runner import Result, Summary
from loadtests.workload import WorkloadSpec, generate, zipf_weights


def test_same_seed_same_workload():
    models = [f"m{i}" for i in range(50)]
    assert generate(models, WorkloadSpec(seed=3)) == generate(models, WorkloadSpec(seed=3))
    assert generate(models, WorkloadSpec(seed=3)) != generate(models, WorkloadSpec(seed=4))


def test_skewed_mix_and_rate():
    models = [f"m{i}" for i in range(100)]
    items = generate(models, WorkloadSpec(rate=50, duration=100, seed=1))
    assert 4500 < len(items) < 5500  # Poisson: 5,000 expected
    counts = Counter(i.model for i in items)
    top = counts["m0"] / len(items)
    assert abs(top - zipf_weights(100, 1.1)[0]) < 0.02
    assert counts["m0"] > 10 * counts.get("m50", 0)  # a few adapters carry most requests
    assert all(0 <= a.at < b.at < 100 for a, b in zip(items, items[1:]))
    assert all(1 <= i.max_tokens <= 64 for i in items)


def test_no_models_is_an_error():
    with pytest.raises(ValueError):
        generate([], WorkloadSpec())


def test_summary_percentiles_and_tpot():
    s = Summary([Result("m", True, 200, ttft=0.1 * k, e2e=0.1 * k + 0.9, tokens=10, tier="gpu") for k in range(1, 11)])
    s.wall = 2.0
    row = s.table()[0]
    assert row["requests"] == 10
    assert row["ttft_p50_ms"] == pytest.approx(500, abs=101)
    assert row["tpot_p50_ms"] == pytest.approx(100)
    assert s.output_tokens_per_s == 50
