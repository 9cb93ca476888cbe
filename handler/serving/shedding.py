"""Admission shedding fair by tenant (issue 35): the rule `LoraHandler.admit` applies to the
replica's two global bounds, the waiting-queue cap (`Limits.max_waiting`, 429 queue_full) and the
bound on queued tokens of work (`Limits.max_queued_tokens`, 503 overloaded + Retry-After). Pure: no
I/O, no locks, no handler state (unit-tested in tests/handler/test_fair_admission.py).

The share rule is the one of the shared prep and grammar queues (`handler.threads.TenantQueues`):

- under the bound (the total with this request <= `cap`) every request is admitted, first come
  first served, as before;
- over it, a tenant is still admitted while what it holds, this request included, fits its share,
  `cap // sharing` with `sharing` the tenants holding some of the count (it included): one tenant
  filling the cap gets every one of its further requests refused, never another tenant's. A
  tenant alone has the whole cap (exactly the global rule); a tenant holding nothing is admitted
  (one request at a time, as a lone request always is);
- never past `ceiling` x the cap (the total with this request): the replica's hard bound,
  whatever the tenants.

A tenant is whatever `LoraHandler` keys requests by (the router's x-lorafarm-tenant; None: one
anonymous tenant, so a replica used without a router sheds exactly as before)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

SHED_CEILING = 2  # no request past this many times a cap, whatever the tenants' shares


def fair_admits(total: int, held: Mapping[Hashable, int], tenant: Hashable, cap: int, add: int = 1,
                ceiling: float = SHED_CEILING) -> bool:
    """May `tenant` add `add` to a shared count now at `total` (each tenant's part in `held`; a
    tenant not in it holds 0) under `cap`? See the module docstring."""
    add = max(0, int(add))
    if total + add <= cap:
        return True
    if total + add > ceiling * cap:
        return False
    mine = max(0, int(held.get(tenant, 0)))
    if mine == 0:
        return True
    sharing = sum(1 for t, v in held.items() if v > 0)  # it included: it holds some
    return mine + add <= cap // max(1, sharing)
