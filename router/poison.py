"""Poison requests: a request body that kills the replicas it is sent to.

A request that was in flight on a replica that *died* (the connection broke mid-request, not a clean
HTTP error, and the replica's `/health` no longer answers) is suspect: the router sends it to at most
`death_retries` more replicas (default 1), and a body seen in flight at `threshold` deaths (default
2) is refused for `cooloff` seconds with a 400 `poison_request`, before it reaches any replica.
Deaths are replica deaths, not requests: when one replica dies with several copies of a body in
flight (a popular prompt, a tenant's probe), that is one death of that body, not several (counting
copies refused a tenant's identical requests for the whole cooloff after one unrelated crash). The
body is known by a fingerprint: sha256 of the tenant, the endpoint and the canonical JSON body
(without `stream`/`stream_options`, so the streamed and plain forms are one body).

Failover for a replica that was already down (connection refused, nothing sent) is not a death.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Hashable

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


class PoisonGuard:
    """Counts distinct replica deaths per fingerprint inside a window of `cooloff` seconds; at
    `threshold` deaths the fingerprint is refused until `cooloff` seconds after the last death.
    Bounded: at most `max_entries` fingerprints are remembered (expired ones first, then the oldest,
    are dropped)."""

    def __init__(self, threshold: int = 2, cooloff: float = 600.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if threshold < 1:
            raise ValueError("poison threshold must be at least 1")
        self.threshold = threshold
        self.cooloff = cooloff
        self.max_entries = max_entries
        self.clock = clock
        self._deaths: dict[str, tuple[frozenset, float]] = {}  # fingerprint -> (deaths, expires at)

    def deaths(self, fp: str) -> int:
        entry = self._deaths.get(fp)
        if entry is None:
            return 0
        if entry[1] <= self.clock():
            del self._deaths[fp]
            return 0
        return len(entry[0])

    def refused_for(self, fp: str) -> float:
        """Seconds of cooling-off left for this fingerprint (0.0: not refused)."""
        entry = self._deaths.get(fp)
        if entry is None or len(entry[0]) < self.threshold:
            return 0.0
        left = entry[1] - self.clock()
        if left <= 0:
            del self._deaths[fp]
            return 0.0
        return left

    def record_death(self, fp: str, death: Hashable | None = None) -> int:
        """A replica died with this body in flight; `death` names that death (every request in flight
        on it passes the same one: it counts once; None: a death of its own). Returns the deaths now
        counted for this body."""
        seen = self._deaths[fp][0] if self.deaths(fp) else frozenset()
        seen = seen | {death if death is not None else object()}
        self._deaths.pop(fp, None)  # re-insert: the dict stays ordered by last death
        self._deaths[fp] = (seen, self.clock() + self.cooloff)
        n = len(seen)
        if len(self._deaths) > self.max_entries:
            self._prune()
        return n

    def _prune(self) -> None:
        now = self.clock()
        for fp in [f for f, (_, exp) in self._deaths.items() if exp <= now]:
            del self._deaths[fp]
        while len(self._deaths) > self.max_entries:
            del self._deaths[next(iter(self._deaths))]

    def __len__(self) -> int:
        return len(self._deaths)
