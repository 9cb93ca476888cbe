"""Rendezvous (highest-random-weight) hashing: which replicas own an adapter.

Every replica gets a score hash(adapter_id, replica_id); the k highest win. Any process computes
the same owners from the replica list alone, with no lookup table, and adding or removing one of
N replicas moves only about 1/N of the placements. Shared by the registry and the router.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping


@functools.lru_cache(maxsize=1 << 18)  # pure: the router scores the same (adapter, replica) pairs all day
def score(adapter_id: str, replica_id: str, weight: float = 1.0) -> float:
    """A deterministic score in (0, inf); `weight` scales a replica's share (weighted HRW)."""
    digest = hashlib.blake2b(f"{adapter_id}\x00{replica_id}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / 2**64  # uniform in (0, 1)
    if weight == 1.0:
        return u
    import math

    return -weight / math.log(u)


def owners(adapter_id: str, replicas: Iterable[str] | Mapping[str, float], k: int = 2) -> list[str]:
    """The top-`k` replicas for `adapter_id`, best first. `replicas` is a list of ids or a mapping
    of id -> capacity weight. k is capped by the number of replicas."""
    weights = dict(replicas) if isinstance(replicas, Mapping) else {r: 1.0 for r in replicas}
    ranked = sorted(weights, key=lambda r: (score(adapter_id, r, weights[r]), r), reverse=True)
    return ranked[: max(0, k)]
