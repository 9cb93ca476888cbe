"""The simulator reproduces measured load tests (stored figures, loadtests/validation.py): device
hit rate and TTFT within stated factors, for affinity and random routing (the small run) and per step
of the at-scale run (2 replicas, 1,000 adapters, 32 and 2 slots per pool, 0.5-4 req/s)."""

from pathlib import Path

import pytest

from loadtests.validation import (AT_SCALE_FIT, AT_SCALE_OUTPUT_TOKENS, AT_SCALE_PROMPT_TOKENS, compare,
                                  compare_at_scale, fit_at_scale, pooled_hit_rate)

STEPS = Path(__file__).resolve().parents[2] / "docs" / "loadtests" / "steps"


def test_simulated_matches_measured_run():
    aff, rnd = compare("affinity"), compare("random")
    for c in (aff, rnd):
        assert 0.85 <= c.factor("device_hit_rate") <= 1.15, (c.routing, c.simulated, c.measured)
        assert 0.67 <= c.factor("p95_ttft_s") <= 1.5, (c.routing, c.simulated, c.measured)
        assert 0.67 <= c.factor("p50_ttft_s") <= 1.5, (c.routing, c.simulated, c.measured)
    # the routing effect the load test measured (93% vs 62% device hits) comes out of the real code
    assert aff.simulated["device_hit_rate"] - rnd.simulated["device_hit_rate"] > 0.2


def test_simulated_matches_at_scale_run():
    """Bounds as stated in docs/scale.md ("Validation against the at-scale run"): the measured run was
    on a CPU-saturated shared box whose speed moved ~2x from minute to minute, so TTFT is held to ~2x
    per step and tighter only where the fit was taken; the 2-slot hit rate is a known under-prediction
    (pinned at 0.6-1.0 so a change in either direction shows)."""
    sweeps = {run: compare_at_scale(run) for run in ("slots32", "slots2")}
    for cs in sweeps.values():
        for c in cs:
            assert 0.5 <= c.factor("p50_ttft_s") <= 2.0, (c.run, c.rate, c.simulated, c.measured)
            assert 0.4 <= c.factor("p95_ttft_s") <= 2.0, (c.run, c.rate, c.simulated, c.measured)
        assert 0.67 <= cs[0].factor("p50_ttft_s") <= 1.5, (cs[0].simulated, cs[0].measured)  # the fitted step
    s32, s2 = sweeps["slots32"], sweeps["slots2"]
    hit32 = pooled_hit_rate(s32, "simulated") / pooled_hit_rate(s32, "measured")
    assert 0.85 <= hit32 <= 1.2, hit32
    for c in s32[1:]:
        assert 0.75 <= c.factor("device_hit_rate") <= 1.33, (c.rate, c.simulated, c.measured)
    hit2 = pooled_hit_rate(s2, "simulated") / pooled_hit_rate(s2, "measured")
    assert 0.6 <= hit2 <= 1.0, hit2
    # thrashing: 2 slots per pool hit the device far less often than 32, as measured (0.39 vs 0.69)
    assert pooled_hit_rate(s2, "simulated") < pooled_hit_rate(s32, "simulated") - 0.2


def test_at_scale_fit_is_the_measured_csvs():
    """The pinned service times are what fit_at_scale() derives from the run's per-request CSVs."""
    # the run's CSVs are tracked in docs/loadtests/steps: missing is a broken tree, not a skip
    assert (STEPS / "slots32-0.5-requests.csv").exists(), f"{STEPS} lacks issue 11's per-request CSVs"
    fit = fit_at_scale(STEPS)
    assert fit["prompt_tokens"] == pytest.approx(AT_SCALE_PROMPT_TOKENS, abs=0.1)
    assert fit["output_tokens"] == pytest.approx(AT_SCALE_OUTPUT_TOKENS, abs=0.1)
    for run, pinned in AT_SCALE_FIT.items():
        for key, value in pinned.items():
            assert fit[run][key] == pytest.approx(value, rel=0.02), (run, key)
