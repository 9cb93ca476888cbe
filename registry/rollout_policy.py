"""The rollout decision, as a pure function: no clock, no database, no I/O.

`decide(...)` looks at one rollout step (which step, how long it has run) and the traffic of the old
and the new version since the step began (`VersionCounts`, summed from the routers' windows), and
says what to do now:

- ROLLBACK at once, at any time in the step, when the new version breaches a bound with evidence:
  - error rate: once the new version has `min_requests` judged requests, the lower end of the 95%
    Wilson interval of its error rate is above the old version's error rate +
    `max_error_rate_increase` (a handful of unlucky errors in a small sample does not count; a
    version whose requests fail is caught after `min_requests` of them);
  - p95 TTFT: once both versions have `min_ttft_samples` streamed requests, the new version's p95
    is above the old one's x `max_ttft_p95_ratio` + `ttft_slack_s`;
- HOLD until the step has run `interval_s`, and then until the new version has `min_requests`
  judged requests (a step is never passed on no evidence);
- at the end of the step, ROLLBACK when the point estimate of the new error rate is above the
  bound (it did not *stay* within it), else ADVANCE to the next step, or PROMOTE when the next step
  is 100%.

The old version's error rate is taken as 0 while it has fewer than `min_requests` judged requests
(no baseline: the new version is held to an error-free one). Requests the client abandoned
(cancels) are judged neither way. Figures behind each decision are returned in `Decision.figures`,
stored with the rollout, and named in the rollback's audit row and log line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lorafarm.client.summary import VersionCounts

HOLD, ADVANCE, PROMOTE, ROLLBACK = "hold", "advance", "promote", "rollback"
ERROR_RATE, TTFT_P95 = "error_rate", "ttft_p95"
Z_95 = 1.959964


@dataclass(frozen=True)
class Bounds:
    """How far the new version may be from the old one within a step (defaults: production)."""

    max_error_rate_increase: float = 0.02  # new error rate <= old error rate + this (absolute)
    max_ttft_p95_ratio: float = 1.5  # new p95 TTFT <= old p95 TTFT x this + ttft_slack_s
    ttft_slack_s: float = 0.05
    min_requests: int = 50  # judged requests on the new version before it may be promoted or failed
    min_ttft_samples: int = 30  # streamed requests on each version before the TTFT bound is judged

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Bounds:
        """Defaults overridden by `d` (unknown keys: ValueError); values checked."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown bound(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        b = cls(**d)
        if not 0 <= b.max_error_rate_increase <= 1:
            raise ValueError("max_error_rate_increase must be within [0, 1]")
        if not 1 <= b.max_ttft_p95_ratio <= 100:
            raise ValueError("max_ttft_p95_ratio must be within [1, 100]")
        if not 0 <= b.ttft_slack_s <= 600:
            raise ValueError("ttft_slack_s must be within [0, 600]")
        if not 1 <= b.min_requests <= 10**7 or not 1 <= b.min_ttft_samples <= 10**7:
            raise ValueError("min_requests and min_ttft_samples must be within [1, 10^7]")
        return b

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    action: str  # hold | advance | promote | rollback
    reason: str
    breached: str | None = None  # the bound a rollback breached: error_rate | ttft_p95
    figures: dict[str, Any] = field(default_factory=dict)


def wilson_lower(errors: int, n: int, z: float = Z_95) -> float:
    """Lower end of the Wilson score interval of a proportion errors/n."""
    if n <= 0:
        return 0.0
    p = errors / n
    denom = 1 + z * z / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - margin) / denom)


def _figures(old: VersionCounts, new: VersionCounts, old_rate: float, bounds: Bounds) -> dict[str, Any]:
    return {
        "old": {"requests": old.requests, "judged": old.judged, "errors": old.errors, "error_rate": old.error_rate,
                "ttft_count": old.ttft_count, "ttft_p95_s": old.ttft_quantile(0.95)},
        "new": {"requests": new.requests, "judged": new.judged, "errors": new.errors, "error_rate": new.error_rate,
                "ttft_count": new.ttft_count, "ttft_p95_s": new.ttft_quantile(0.95),
                "error_rate_lower_95": wilson_lower(new.errors, new.judged)},
        "error_rate_limit": old_rate + bounds.max_error_rate_increase,
    }


def decide(
    *,
    steps: Sequence[int],
    step_index: int,
    elapsed_s: float,
    interval_s: float,
    old: VersionCounts,
    new: VersionCounts,
    bounds: Bounds,
) -> Decision:
    """What a rollout at `steps[step_index]` percent, `elapsed_s` into its step, does now."""
    baseline = old.judged >= bounds.min_requests
    old_rate = (old.error_rate or 0.0) if baseline else 0.0
    limit = old_rate + bounds.max_error_rate_increase
    figures = _figures(old, new, old_rate, bounds)
    percent = steps[step_index]
    old_desc = f"old {old_rate:.4f}" if baseline else f"old taken as 0 ({old.judged} < {bounds.min_requests} requests)"
    n = new.judged

    # 1. a breach with evidence: roll back now, whatever the step's age
    if n >= bounds.min_requests:
        lower = wilson_lower(new.errors, n)
        if lower > limit:
            return Decision(ROLLBACK, f"error_rate bound breached: new version {new.errors}/{n} requests failed "
                            f"(rate {new.errors / n:.4f}, >= {lower:.4f} at 95% confidence) > {old_desc} + "
                            f"max_error_rate_increase {bounds.max_error_rate_increase:g}", ERROR_RATE, figures)
    ttft_judged = old.ttft_count >= bounds.min_ttft_samples and new.ttft_count >= bounds.min_ttft_samples
    if ttft_judged:
        old_p95, new_p95 = old.ttft_quantile(0.95) or 0.0, new.ttft_quantile(0.95) or 0.0
        ttft_limit = old_p95 * bounds.max_ttft_p95_ratio + bounds.ttft_slack_s
        figures["ttft_p95_limit_s"] = ttft_limit
        if new_p95 > ttft_limit:
            return Decision(ROLLBACK, f"ttft_p95 bound breached: new version p95 TTFT {new_p95:.3f} s over "
                            f"{new.ttft_count} streamed requests > old {old_p95:.3f} s x max_ttft_p95_ratio "
                            f"{bounds.max_ttft_p95_ratio:g} + ttft_slack_s {bounds.ttft_slack_s:g}", TTFT_P95, figures)

    # 2. the step's time and evidence
    if elapsed_s < interval_s:
        return Decision(HOLD, f"step {percent}%: {interval_s - elapsed_s:.1f} s left", None, figures)
    if n < bounds.min_requests:
        return Decision(HOLD, f"step {percent}%: waiting for traffic ({n}/{bounds.min_requests} judged requests on "
                        "the new version)", None, figures)

    # 3. end of the step: within bounds (point estimates) or not
    rate = new.errors / n
    if rate > limit:
        return Decision(ROLLBACK, f"error_rate bound breached at the end of step {percent}%: new version rate "
                        f"{rate:.4f} ({new.errors}/{n}) > {old_desc} + max_error_rate_increase "
                        f"{bounds.max_error_rate_increase:g}", ERROR_RATE, figures)
    ttft_note = "" if ttft_judged else (f"; ttft_p95 not judged (streamed requests old {old.ttft_count}, new "
                                        f"{new.ttft_count}, < {bounds.min_ttft_samples})")
    within = f"within bounds over {interval_s:g} s (error rate {rate:.4f} <= {limit:.4f}{ttft_note})"
    nxt = step_index + 1
    if nxt >= len(steps) or steps[nxt] >= 100:
        return Decision(PROMOTE, f"step {percent}% {within}: promoted to 100%", None, figures)
    return Decision(ADVANCE, f"step {percent}% {within}: next step {steps[nxt]}%", None, figures)


def check_steps(steps: Sequence[int]) -> list[int]:
    """Steps of a rollout: increasing percents in [1, 100], ending at 100, at least one below it."""
    out = [int(s) for s in steps]
    if not 2 <= len(out) <= 20:
        raise ValueError("steps: give 2 to 20 percents ending at 100 (e.g. 10,50,100)")
    if any(not 1 <= s <= 100 for s in out) or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError("steps must be increasing percents within [1, 100]")
    if out[-1] != 100:
        raise ValueError("the last step must be 100 (the promotion)")
    return out
