"""Poison requests: a request body that kills the replicas it is sent to.

A request that was in flight on a replica that *died* (the connection broke mid-request, not a clean
HTTP error, and the replica's `/health` no longer answers) is suspect: the router sends it to at most
`death_retries` more replicas (default 1). A body is refused as poison only on evidence that it
kills replicas, never because it was popular when one died:

- it was in flight when `threshold` (default 2) **distinct** replicas died: deaths of one replica
  count once however often it dies (a crash loop or an OOM-killed replica that restarts and dies
  again never makes the bodies it held poison), and one death with several copies of a body in
  flight is one death;
- and it has **not completed** (a 2xx answer relayed whole) on any replica since the first of those
  deaths: a body that completes anywhere is cleared, its deaths forgotten. A popular body that was
  in flight at an ordinary crash is retried and completes elsewhere, so it is never refused.

Such a body is refused for `cooloff` seconds after its last death with a 400 `poison_request`
before it reaches any replica; the message says what was seen ("was in flight when replicas r0 and
r1 died, and has not completed on any replica since"). The body is known by a fingerprint: sha256
of the tenant, the endpoint and the canonical JSON body (without `stream`/`stream_options`, so the
streamed and plain forms are one body).

Failover for a replica that was already down (connection refused, nothing sent) is not a death.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

_IGNORED_KEYS = ("stream", "stream_options")


def fingerprint(tenant_id: str, endpoint: str, body: dict) -> str:
    """The poison fingerprint of a request: the same tenant sending the same body to the same
    endpoint gets the same one."""
    canon = {k: v for k, v in body.items() if k not in _IGNORED_KEYS}
    raw = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    h = hashlib.sha256()
    for part in (tenant_id, endpoint, raw):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()[:32]


@dataclass
class _Suspect:
    """What was seen of one body: the replicas that died with it in flight (replica -> the deaths of
    it, each named once), since its first death, and when it stops being remembered."""

    replicas: dict[str, set] = field(default_factory=dict)
    expires: float = 0.0


class PoisonGuard:
    """Per fingerprint: the distinct replicas that died with it in flight, until it completes
    somewhere or `cooloff` seconds pass after its last death. At `threshold` distinct replicas the
    fingerprint is refused. Bounded: at most `max_entries` fingerprints are remembered (expired ones
    first, then the oldest, are dropped)."""

    def __init__(self, threshold: int = 2, cooloff: float = 600.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if threshold < 1:
            raise ValueError("poison threshold must be at least 1")
        self.threshold = threshold
        self.cooloff = cooloff
        self.max_entries = max_entries
        self.clock = clock
        self._suspects: dict[str, _Suspect] = {}

    def _get(self, fp: str) -> _Suspect | None:
        s = self._suspects.get(fp)
        if s is not None and s.expires <= self.clock():
            del self._suspects[fp]
            return None
        return s

    def deaths(self, fp: str) -> int:
        """The distinct replicas that died with this body in flight (since its first death, while it
        has not completed anywhere)."""
        s = self._get(fp)
        return len(s.replicas) if s else 0

    def replicas(self, fp: str) -> dict[str, int]:
        """Replica id -> how many of its deaths this body was in flight at."""
        s = self._get(fp)
        return {r: len(d) for r, d in s.replicas.items()} if s else {}

    def refused_for(self, fp: str) -> float:
        """Seconds of cooling-off left for this fingerprint (0.0: not refused)."""
        s = self._get(fp)
        if s is None or len(s.replicas) < self.threshold:
            return 0.0
        return s.expires - self.clock()

    def record_death(self, fp: str, replica_id: str, death: Hashable | None = None) -> int:
        """Replica `replica_id` died with this body in flight; `death` names that death (every
        request in flight on it passes the same one: it counts once; None: a death of its own).
        Returns the distinct replicas now counted for this body."""
        s = self._get(fp)
        if s is None:
            s = _Suspect()
        self._suspects.pop(fp, None)  # re-insert: the dict stays ordered by last death
        s.replicas.setdefault(replica_id, set()).add(death if death is not None else object())
        s.expires = self.clock() + self.cooloff
        self._suspects[fp] = s
        if len(self._suspects) > self.max_entries:
            self._prune()
        return len(s.replicas)

    def completed(self, fp: str | None) -> bool:
        """A request with this body completed (2xx, relayed whole): it does not kill replicas, its
        deaths are forgotten (a refusal too). True when there was something to forget."""
        return fp is not None and self._suspects.pop(fp, None) is not None

    def describe(self, fp: str) -> str:
        """What was seen, for the refusal: "replicas r0 and r1" or "replica r0 (twice)"."""
        seen = self.replicas(fp)
        parts = [r + (f" ({_times(n)})" if n > 1 else "") for r, n in seen.items()]
        if not parts:
            return "replicas"
        if len(parts) == 1:
            return f"replica {parts[0]}"
        return "replicas " + ", ".join(parts[:-1]) + " and " + parts[-1]

    def _prune(self) -> None:
        now = self.clock()
        for fp in [f for f, s in self._suspects.items() if s.expires <= now]:
            del self._suspects[fp]
        while len(self._suspects) > self.max_entries:
            del self._suspects[next(iter(self._suspects))]

    def __len__(self) -> int:
        return len(self._suspects)


def _times(n: int) -> str:
    return {2: "twice", 3: "three times"}.get(n, f"{n} times")
