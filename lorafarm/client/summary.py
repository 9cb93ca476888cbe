"""Per-version traffic figures: what a router counts for each (alias, version) of a split alias, what
it pushes to the registry every stats window, and what the registry sums over a rollout step.

One mergeable shape, `VersionCounts`, used by all three (router, registry, client), so a summary read
from the registry, from a router's `GET /internal/versions`, or summed by hand are the same numbers:

- `requests`: requests routed to the version (every outcome below counts once here);
- `errors`: failures that are the server's (the replica answered 5xx, no replica could serve it, the
  replica died or broke the stream, the deadline passed), by kind in `error_kinds`;
- `client_errors`: 4xx answers (the request's own fault; not held against the version);
- `cancels`: the client went away before the answer was complete;
- `ttft`: time to first token of streamed requests, as counts in fixed log-spaced buckets
  (`TTFT_BUCKETS_S`, 15% apart: a percentile read from them is within 15% of the exact one);
- `prompt_tokens`, `completion_tokens`, `finish_reasons` (stop, length, tool_calls, ...).

Rates: `error_rate` = errors / (requests - cancels) (a request the client abandoned proves nothing),
`cancel_rate` = cancels / requests.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

# upper edges of the TTFT buckets: 1 ms x 1.15^i, i = 0..95 (1 ms .. ~660 s); one more bucket above
TTFT_BUCKETS_S: tuple[float, ...] = tuple(0.001 * 1.15**i for i in range(96))


def ttft_bucket(seconds: float) -> int:
    """Index of the bucket `seconds` falls in (len(TTFT_BUCKETS_S) for the overflow bucket)."""
    return bisect.bisect_left(TTFT_BUCKETS_S, max(0.0, float(seconds)))


@dataclass
class VersionCounts:
    """Counts of one version over some span; `merge` adds another span's."""

    requests: int = 0
    errors: int = 0
    client_errors: int = 0
    cancels: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    ttft: dict[int, int] = field(default_factory=dict)  # bucket index -> count

    # -- recording ----------------------------------------------------------------------------

    def add_error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def add_ttft(self, seconds: float) -> None:
        b = ttft_bucket(seconds)
        self.ttft[b] = self.ttft.get(b, 0) + 1

    def add_finish(self, reasons: dict[str, int]) -> None:
        for r, n in reasons.items():
            self.finish_reasons[r] = self.finish_reasons.get(r, 0) + n

    def merge(self, other: VersionCounts) -> VersionCounts:
        self.requests += other.requests
        self.errors += other.errors
        self.client_errors += other.client_errors
        self.cancels += other.cancels
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        for mine, theirs in ((self.error_kinds, other.error_kinds), (self.finish_reasons, other.finish_reasons)):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
        for b, n in other.ttft.items():
            self.ttft[b] = self.ttft.get(b, 0) + n
        return self

    # -- derived ------------------------------------------------------------------------------

    @property
    def judged(self) -> int:
        """Requests that completed or failed (not abandoned by their client)."""
        return max(0, self.requests - self.cancels)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.judged if self.judged else None

    @property
    def cancel_rate(self) -> float | None:
        return self.cancels / self.requests if self.requests else None

    @property
    def ttft_count(self) -> int:
        return sum(self.ttft.values())

    def ttft_quantile(self, q: float) -> float | None:
        """The q-quantile of TTFT (seconds), interpolated inside its bucket; None without samples."""
        total = self.ttft_count
        if not total:
            return None
        rank = q * total
        seen = 0
        for b in sorted(self.ttft):
            n = self.ttft[b]
            if seen + n >= rank:
                lo = TTFT_BUCKETS_S[b - 1] if 0 < b <= len(TTFT_BUCKETS_S) else 0.0
                hi = TTFT_BUCKETS_S[b] if b < len(TTFT_BUCKETS_S) else TTFT_BUCKETS_S[-1] * 1.15
                return lo + (hi - lo) * ((rank - seen) / n if n else 1.0)
            seen += n
        return TTFT_BUCKETS_S[-1]

    # -- wire ---------------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """The counts as pushed and stored (ttft buckets sparse, keys as strings for JSON)."""
        return {
            "requests": self.requests, "errors": self.errors, "client_errors": self.client_errors,
            "cancels": self.cancels, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "error_kinds": dict(self.error_kinds),
            "finish_reasons": dict(self.finish_reasons), "ttft": {str(b): n for b, n in sorted(self.ttft.items())},
        }  # fmt: skip

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> VersionCounts:
        def ints(m) -> dict:
            return {str(k): int(v) for k, v in (m or {}).items()}

        ttft = {}
        for k, v in (d.get("ttft") or {}).items():
            try:
                b = int(k)
            except (TypeError, ValueError):
                continue
            if 0 <= b <= len(TTFT_BUCKETS_S):
                ttft[b] = ttft.get(b, 0) + int(v)
        return cls(
            requests=int(d.get("requests") or 0), errors=int(d.get("errors") or 0),
            client_errors=int(d.get("client_errors") or 0), cancels=int(d.get("cancels") or 0),
            prompt_tokens=int(d.get("prompt_tokens") or 0), completion_tokens=int(d.get("completion_tokens") or 0),
            error_kinds=ints(d.get("error_kinds")), finish_reasons=ints(d.get("finish_reasons")), ttft=ttft,
        )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The readable summary (`VersionSummary` in lorafarm.client.types): counts and rates."""
        p50, p95 = self.ttft_quantile(0.5), self.ttft_quantile(0.95)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": _round(self.error_rate),
            "error_kinds": dict(sorted(self.error_kinds.items())),
            "client_errors": self.client_errors,
            "cancels": self.cancels,
            "cancel_rate": _round(self.cancel_rate),
            "ttft_count": self.ttft_count,
            "ttft_p50_s": _round(p50),
            "ttft_p95_s": _round(p95),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
        }


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None or math.isnan(x) else round(x, digits)
