"""Placement: which replicas own an adapter, and how many owners its traffic needs.

Owners are computed, never stored by hand: `lorafarm.rendezvous.owners(adapter_id, replicas, k)`
over the replicas that are up and serve the adapter's base model (weighted by capacity_weight).

The owner count k starts at `owners_k` (2). Each adapter carries an exponentially decaying
tokens/s estimate: every stats window adds `tokens / tau` and the estimate decays as
`exp(-dt / tau)`, so it follows the recent rate, adds up across several routers, and cools by
itself when traffic stops. k rises to ceil(rate / capacity) as soon as the rate exceeds
k x capacity (per-replica tokens/s, the seed's 640), and falls back only when the rate is below
`cooldown_ratio` of what k - 1 replicas serve (hysteresis, so k doesn't flap). Effective k is
capped by the number of eligible replicas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime

from lorafarm.rendezvous import owners as rendezvous_owners

MAX_OWNERS_K = 4096
RATE_FLOOR = 1e-3  # tokens/s below which an adapter counts as idle


def decayed_rate(rate: float, updated_at: datetime | None, now: datetime, tau_s: float) -> float:
    if rate <= 0 or updated_at is None:
        return 0.0
    dt = max(0.0, (now - updated_at).total_seconds())
    value = rate * math.exp(-dt / tau_s)
    return value if value >= RATE_FLOOR else 0.0


def add_window(rate: float, updated_at: datetime | None, now: datetime, tokens: float, tau_s: float) -> float:
    """The estimate after a stats window of `tokens` ends at `now`."""
    return decayed_rate(rate, updated_at, now, tau_s) + max(0.0, tokens) / tau_s


def owner_count(rate: float, current_k: int, *, k_min: int, capacity: float, cooldown_ratio: float) -> int:
    """The owner count for an adapter at `rate` tokens/s that now has `current_k` owners."""
    current_k = max(k_min, current_k)
    need = max(k_min, math.ceil(rate / capacity)) if rate > 0 else k_min
    if need > current_k:
        return min(need, MAX_OWNERS_K)
    if current_k > k_min and rate < (current_k - 1) * capacity * cooldown_ratio:
        lower = max(k_min, math.ceil(rate / (capacity * cooldown_ratio))) if rate > 0 else k_min
        return min(current_k, lower)
    return current_k


def eligible(replicas: Iterable, base_model_hash: str) -> dict[str, float]:
    """replica_id -> capacity_weight of the replicas that are up and serve this base."""
    return {
        r.replica_id: float(r.capacity_weight or 1.0)
        for r in replicas
        if r.status == "up" and r.base_model_hash == base_model_hash
    }


def effective_k(owners_k: int, candidates: dict[str, float]) -> int:
    return min(max(1, owners_k), len(candidates))


def owners_for(adapter_id: str, owners_k: int, candidates: dict[str, float]) -> list[str]:
    return rendezvous_owners(adapter_id, candidates, effective_k(owners_k, candidates))
