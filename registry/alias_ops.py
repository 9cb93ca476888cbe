"""Changes to an alias inside a write transaction, shared by the alias endpoints and the rollout
driver (registry/rollout.py): point it at one version, split its traffic, promote, roll back, and end
a rollout that a change by hand overrides. The caller audits, bumps the routing-table version and
waits for the routers (read-your-writes)."""

from __future__ import annotations

import math
import re

from sqlalchemy import select

from registry.errors import ApiError
from registry.schemas import ALIAS_PATTERN
from registry.tables import Adapter, Alias, Rollout, Tenant, utcnow

_ALIAS_RE = re.compile(ALIAS_PATTERN)
MAX_SPLIT = 8  # versions in one split


def check_alias_name(alias: str, tenant_id: str | None = None) -> str:
    """The alias's tenant; 422 when malformed or, given `tenant_id`, owned by another tenant."""
    if not _ALIAS_RE.fullmatch(alias):  # fullmatch: `$` would let a trailing newline through
        raise ApiError(422, f"alias {alias!r} is not of the form <tenant_id>/<name>:<tag>", code="invalid_alias",
                       param="alias")
    owner = alias.split("/", 1)[0]
    if tenant_id is not None and owner != tenant_id:
        raise ApiError(422, f"alias {alias} belongs to tenant {owner!r}, not {tenant_id!r}", code="alias_not_owned",
                       param="alias")
    return owner


async def check_target(session, alias: str, owner: str, adapter_id: str, *, active: bool = False) -> Adapter:
    """The adapter an alias of `owner` may point at (422 otherwise)."""
    adapter = await session.get(Adapter, adapter_id)
    if adapter is None:
        raise ApiError(422, f"no adapter {adapter_id}", code="adapter_not_found", param="adapter_id")
    if adapter.tenant_id != owner:
        raise ApiError(422, f"adapter {adapter_id} belongs to tenant {adapter.tenant_id!r}; alias {alias} "
                       f"belongs to {owner!r}", code="alias_not_owned", param="adapter_id")
    if active and adapter.status != "active":
        raise ApiError(422, f"adapter {adapter_id} is {adapter.status}: enable it before sending traffic to it",
                       code="adapter_disabled", param="adapter_id")
    return adapter


async def check_owner(session, alias: str) -> str:
    owner = check_alias_name(alias)
    if await session.get(Tenant, owner) is None:
        raise ApiError(422, f"alias {alias}: no tenant {owner!r}", code="tenant_not_found", param="alias")
    return owner


def split_of(row: Alias | None) -> list[dict] | None:
    """The alias's split as [{adapter_id, weight}], or None (all traffic to adapter_id)."""
    if row is None or not row.split:
        return None
    return [{"adapter_id": str(t["adapter_id"]), "weight": float(t["weight"])} for t in row.split]


def split_ids(row: Alias | None) -> set[str]:
    return {t["adapter_id"] for t in split_of(row) or ()}


async def set_single(session, alias: str, adapter_id: str) -> tuple[Alias, bool]:
    """Point `alias` at `adapter_id` alone (creating it; ending a split). -> (row, changed)."""
    owner = await check_owner(session, alias)
    await check_target(session, alias, owner, adapter_id)
    row = await session.get(Alias, alias)
    if row is None:
        row = Alias(alias=alias, tenant_id=owner, adapter_id=adapter_id, previous_adapter_id=None, updated_at=utcnow())
        session.add(row)
        await session.flush()
        return row, True
    changed = row.adapter_id != adapter_id or row.split is not None
    if row.adapter_id != adapter_id:
        row.previous_adapter_id = row.adapter_id
        row.adapter_id = adapter_id
    row.split = None
    if changed:
        row.updated_at = utcnow()
    await session.flush()
    return row, changed


def normalize_split(targets: list[dict]) -> list[dict]:
    """Distinct ids, positive weights summing to 100 (within 0.01) -> [{adapter_id, weight}]."""
    if not 2 <= len(targets) <= MAX_SPLIT:
        raise ApiError(422, f"a split names 2 to {MAX_SPLIT} versions (one version: PUT the alias instead)",
                       code="invalid_split", param="targets")
    ids = [str(t["adapter_id"]) for t in targets]
    if len(set(ids)) != len(ids):
        raise ApiError(422, "a split names each version once", code="invalid_split", param="targets")
    weights = [float(t["weight"]) for t in targets]
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ApiError(422, "split weights must be positive percents", code="invalid_split", param="targets")
    if abs(sum(weights) - 100.0) > 0.01:
        raise ApiError(422, f"split weights are percents summing to 100, not {sum(weights):g}", code="invalid_split",
                       param="targets")
    return [{"adapter_id": a, "weight": w} for a, w in zip(ids, weights)]


async def set_split(session, alias: str, targets: list[dict], *, stable: str | None = None) -> tuple[Alias, bool]:
    """Split `alias`'s traffic over `targets` (normalized). Its stable version (adapter_id) is
    `stable`, else the current one when it is in the split, else the heaviest. -> (row, changed)."""
    owner = await check_owner(session, alias)
    targets = normalize_split(targets)
    for t in targets:
        await check_target(session, alias, owner, t["adapter_id"], active=True)
    ids = [t["adapter_id"] for t in targets]
    row = await session.get(Alias, alias)
    if stable is None:
        if row is not None and row.adapter_id in ids:
            stable = row.adapter_id
        else:
            stable = max(targets, key=lambda t: t["weight"])["adapter_id"]
    if stable not in ids:
        raise ApiError(422, f"the stable version {stable} is not in the split", code="invalid_split")
    if row is None:
        row = Alias(alias=alias, tenant_id=owner, adapter_id=stable, previous_adapter_id=None, updated_at=utcnow(),
                    split=targets)
        session.add(row)
        await session.flush()
        return row, True
    changed = row.adapter_id != stable or split_of(row) != targets
    if row.adapter_id != stable:
        row.previous_adapter_id = row.adapter_id
        row.adapter_id = stable
    row.split = targets
    if changed:
        row.updated_at = utcnow()
    await session.flush()
    return row, changed


async def running_rollout(session, alias: str) -> Rollout | None:
    return (await session.execute(select(Rollout).where(Rollout.active_alias == alias))).scalars().first()


def finish_rollout(r: Rollout, state: str, reason: str, breached: str | None = None) -> None:
    now = utcnow()
    r.state = state
    r.reason = reason[:1024]
    r.breached = breached
    r.active_alias = None
    r.updated_at = now
    r.finished_at = now


async def end_rollout_by_hand(session, alias: str, action: str, actor: str, *, promoted_to: str | None = None) -> Rollout | None:
    """A change by hand to an alias with a running rollout ends the rollout: promoted when the new
    version was promoted by hand, rolled_back by a rollback, aborted otherwise. -> the rollout."""
    r = await running_rollout(session, alias)
    if r is None:
        return None
    if action == "alias.promote" and promoted_to == r.new_adapter_id:
        finish_rollout(r, "promoted", f"promoted by hand ({actor})")
    elif action == "alias.rollback":
        finish_rollout(r, "rolled_back", f"rolled back by hand ({actor})")
    else:
        finish_rollout(r, "aborted", f"ended by {action} by hand ({actor})")
    await session.flush()
    return r
