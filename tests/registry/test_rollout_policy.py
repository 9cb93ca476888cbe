"""The rollout decision (registry/rollout_policy.py) as a pure function: no process, no database."""

from __future__ import annotations

import pytest

from lorafarm.client.summary import VersionCounts
from registry.rollout_policy import (
    ADVANCE,
    ERROR_RATE,
    HOLD,
    PROMOTE,
    ROLLBACK,
    TTFT_P95,
    Bounds,
    check_steps,
    decide,
    wilson_lower,
)

B = Bounds(max_error_rate_increase=0.02, max_ttft_p95_ratio=1.5, ttft_slack_s=0.05, min_requests=20,
           min_ttft_samples=10)


def counts(requests: int, errors: int = 0, ttft: float | None = None, cancels: int = 0) -> VersionCounts:
    c = VersionCounts(requests=requests, cancels=cancels)
    for _ in range(errors):
        c.add_error("upstream_5xx")
    if ttft is not None:
        for _ in range(requests - errors - cancels):
            c.add_ttft(ttft)
    return c


def run(step_index=0, elapsed=10.0, interval=10.0, old=None, new=None, steps=(10, 50, 100), bounds=B):
    return decide(steps=steps, step_index=step_index, elapsed_s=elapsed, interval_s=interval,
                  old=old or counts(0), new=new or counts(0), bounds=bounds)


def test_holds_until_the_interval_then_advances_then_promotes():
    healthy_old, healthy_new = counts(400, 2, 0.1), counts(40, 0, 0.1)
    assert run(elapsed=3, old=healthy_old, new=healthy_new).action == HOLD
    d = run(elapsed=10, old=healthy_old, new=healthy_new)
    assert d.action == ADVANCE and "next step 50%" in d.reason
    d = run(step_index=1, elapsed=10, old=healthy_old, new=healthy_new)
    assert d.action == PROMOTE and "promoted to 100%" in d.reason
    assert run(steps=(10, 100), elapsed=10, old=healthy_old, new=healthy_new).action == PROMOTE


def test_no_promotion_without_evidence():
    d = run(elapsed=1000, old=counts(400, 0, 0.1), new=counts(5, 0, 0.1))
    assert d.action == HOLD and "waiting for traffic (5/20" in d.reason


def test_failing_version_rolled_back_before_the_interval_ends():
    # every request of the new version fails: caught at min_requests, long before the step's end
    d = run(elapsed=1.0, interval=300, old=counts(200, 0, 0.1), new=counts(20, 20))
    assert d.action == ROLLBACK and d.breached == ERROR_RATE
    assert "error_rate bound breached" in d.reason and "max_error_rate_increase 0.02" in d.reason
    assert d.figures["new"]["errors"] == 20
    # fewer than min_requests: not judged yet, whatever the rate
    assert run(elapsed=1.0, interval=300, old=counts(200), new=counts(19, 19)).action == HOLD


def test_a_few_unlucky_errors_are_not_an_early_breach_but_fail_the_step_end():
    old, new = counts(1000, 10, 0.1), counts(40, 2, 0.1)  # 1% vs 5%: lower 95% bound of 2/40 is ~1.4%
    assert wilson_lower(2, 40) < 0.03
    assert run(elapsed=1, interval=10, old=old, new=new).action == HOLD
    d = run(elapsed=10, interval=10, old=old, new=new)  # at the end the point estimate must be within
    assert d.action == ROLLBACK and d.breached == ERROR_RATE and "end of step 10%" in d.reason


def test_error_rate_is_relative_to_the_old_version():
    # the old version fails 10% too: a new one at 11% is within old + 2%
    d = run(elapsed=10, old=counts(1000, 100, 0.1), new=counts(100, 11, 0.1))
    assert d.action == ADVANCE


def test_old_without_baseline_is_held_to_zero():
    d = run(elapsed=10, old=counts(5, 5), new=counts(30, 3, 0.1))
    assert d.action == ROLLBACK and "old taken as 0" in d.reason


def test_cancels_are_judged_neither_way():
    # 30 requests, 25 abandoned by their clients: 5 judged < min_requests: hold
    assert run(elapsed=10, old=counts(400), new=counts(30, cancels=25)).action == HOLD


def test_ttft_bound():
    old = counts(100, 0, 0.2)
    d = run(elapsed=1, old=old, new=counts(30, 0, 0.5))  # 0.5 > 0.2 x 1.5 + 0.05
    assert d.action == ROLLBACK and d.breached == TTFT_P95 and "ttft_p95 bound breached" in d.reason
    assert run(elapsed=10, old=old, new=counts(30, 0, 0.3)).action == ADVANCE  # 0.3 <= 0.35
    # too few streamed requests: the TTFT bound is not judged, and the reason says so
    d = run(elapsed=10, old=old, new=counts(20, 0, None))
    assert d.action == ADVANCE and "ttft_p95 not judged" in d.reason


def test_bounds_and_steps_checked():
    assert Bounds.from_dict({"min_requests": 5}).min_requests == 5
    for bad in ({"nope": 1}, {"max_error_rate_increase": 2}, {"max_ttft_p95_ratio": 0.5}, {"min_requests": 0}):
        with pytest.raises(ValueError):
            Bounds.from_dict(bad)
    assert check_steps([10, 50, 100]) == [10, 50, 100]
    for bad in ([100], [10, 50], [50, 10, 100], [0, 100], [10, 10, 100], list(range(1, 30)) + [100]):
        with pytest.raises(ValueError):
            check_steps(bad)


def test_wilson_lower_bound():
    assert wilson_lower(0, 100) == 0.0
    assert 0.7 < wilson_lower(10, 10) < 0.75  # 10/10 failed: >= 72% at 95% confidence
    assert wilson_lower(0, 0) == 0.0
