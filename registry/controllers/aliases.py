"""Aliases: `<tenant_id>/<name>:<tag>` -> adapter id, or a weighted split of several. PUT deploys one
version (keeping the previous one), PUT .../split splits the traffic (e.g. v7 90 / v8 10),
POST .../promote ends a split on one version, POST .../rollback returns all traffic to the stable
version (a split) or swaps back to the previous one. GET .../metrics: per-version traffic pushed by
the routers. Routes are /internal/aliases/{tenant_id}/{name}: the slash of the alias is a path
separator, so `PUT /internal/aliases/acme/support:prod` works as written.

Every change bumps the routing-table version and returns once the routers long-polling this
registry applied it (read-your-writes), is audited, and ends a rollout running on the alias (a
change by hand wins over the rollout driver)."""

from __future__ import annotations

from datetime import datetime, timedelta

from litestar import Controller, Request, delete, get, post, put
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy import select

from registry import audit
from registry.alias_ops import (
    check_alias_name,
    end_rollout_by_hand,
    running_rollout,
    set_single,
    set_split,
    split_of,
)
from registry.context import RegistryContext
from registry.controllers.common import admin_guard, alias_out, errors, get_ctx, reject_unknown_query
from registry.errors import ApiError
from registry.schemas import (
    ALIAS_NAME_PATTERN,
    TENANT_ID_PATTERN,
    AliasMetricsOut,
    AliasOut,
    AliasPromote,
    AliasSet,
    AliasSplit,
)
from registry.tables import Alias, Rollout, as_utc, utcnow

__all__ = ["AliasController", "apply_alias", "check_alias_name"]

TenantId = Parameter(pattern=TENANT_ID_PATTERN, description="the alias's tenant (before the slash)")
AliasName = Parameter(pattern=ALIAS_NAME_PATTERN, description="`name:tag` (after the slash)")


async def apply_alias(ctx: RegistryContext, session, alias: str, adapter_id: str) -> Alias:
    """Point `alias` at `adapter_id` alone inside a write transaction (the caller audits and bumps
    the version). A split on it ends; so does a rollout running on it (audited here)."""
    row, changed = await set_single(session, alias, adapter_id)
    if changed:
        r = await end_rollout_by_hand(session, alias, "alias.set", "upload with alias")
        if r is not None:
            audit.record_as(session, "registry", None, "rollout.abort", "alias", alias, rollout_id=r.rollout_id,
                            reason=r.reason)
    return row


async def _alias_or_404(session, alias: str) -> Alias:
    row = await session.get(Alias, alias)
    if row is None:
        raise ApiError(404, f"no alias {alias}", code="alias_not_found", param="alias")
    return row


async def _end_rollout(session, request: Request, alias: str, action: str, promoted_to: str | None = None) -> None:
    actor, _ = audit.who(request)
    r = await end_rollout_by_hand(session, alias, action, actor, promoted_to=promoted_to)
    if r is not None:
        audit.record(session, request, f"rollout.{'abort' if r.state == 'aborted' else 'end'}", "alias", alias,
                     rollout_id=r.rollout_id, state=r.state, reason=r.reason)


def _out(row: Alias, rollout: Rollout | None = None) -> AliasOut:
    return AliasOut(**alias_out(row, rollout.rollout_id if rollout is not None else None))


class AliasController(Controller):
    path = "/internal/aliases"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["aliases"]

    @put("/{tenant_id:str}/{name:str}", responses=errors(422),
         summary="Deploy: point the alias <tenant_id>/<name> at one adapter (keeps the previous one; ends a split)")
    async def set_alias(
        self, ctx: RegistryContext, request: Request, data: AliasSet, tenant_id: str = TenantId,
        name: str = AliasName,
    ) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.write() as session:
            before = await session.get(Alias, alias)
            previous = before.adapter_id if before is not None else None
            previous_split = split_of(before)
            row, changed = await set_single(session, alias, data.adapter_id)
            if changed:
                audit.record(session, request, "alias.set", "alias", alias, adapter_id=data.adapter_id,
                             previous_adapter_id=previous, previous_split=previous_split)
                await _end_rollout(session, request, alias, "alias.set")
                await ctx.db.bump(session)
            out = _out(row)
        await ctx.wait_for_routers()  # read-your-writes: routers serve the new target when this returns
        return out

    @put("/{tenant_id:str}/{name:str}/split", responses=errors(422),
         summary="Split the alias's traffic over versions by weight (percents summing to 100)")
    async def split(
        self, ctx: RegistryContext, request: Request, data: AliasSplit, tenant_id: str = TenantId,
        name: str = AliasName,
    ) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.write() as session:
            before = await session.get(Alias, alias)
            previous_split = split_of(before)
            previous = before.adapter_id if before is not None else None
            row, changed = await set_split(session, alias, [t.model_dump() for t in data.targets])
            if changed:
                audit.record(session, request, "alias.split", "alias", alias, adapter_id=row.adapter_id,
                             split=split_of(row), previous_split=previous_split, previous_adapter_id=previous)
                await _end_rollout(session, request, alias, "alias.split")
                await ctx.db.bump(session)
            out = _out(row)
        await ctx.wait_for_routers()
        return out

    @post("/{tenant_id:str}/{name:str}/promote", status_code=200, responses=errors(404, 422),
          summary="End a split: all traffic to one version (default: the split's version other than the stable one)")
    async def promote(
        self, ctx: RegistryContext, request: Request, tenant_id: str = TenantId, name: str = AliasName,
        data: AliasPromote | None = None,
    ) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.write() as session:
            before = await _alias_or_404(session, alias)
            previous_split = split_of(before)
            target = data.adapter_id if data is not None else None
            if target is None:
                others = [t["adapter_id"] for t in previous_split or () if t["adapter_id"] != before.adapter_id]
                if len(others) != 1:
                    raise ApiError(422, f"alias {alias} has {'no split' if not previous_split else 'several'} "
                                   "other versions: name the adapter_id to promote", code="promote_ambiguous",
                                   param="adapter_id")
                target = others[0]
            stable = before.adapter_id
            row, changed = await set_single(session, alias, target)
            if changed:
                audit.record(session, request, "alias.promote", "alias", alias, adapter_id=target,
                             previous_adapter_id=stable, previous_split=previous_split)
                await _end_rollout(session, request, alias, "alias.promote", promoted_to=target)
                await ctx.db.bump(session)
            out = _out(row)
        await ctx.wait_for_routers()
        return out

    @post("/{tenant_id:str}/{name:str}/rollback", status_code=200, responses=errors(404, 409),
          summary="Roll back: a split sends all traffic back to the stable version; else swap with the previous adapter")
    async def rollback(self, ctx: RegistryContext, request: Request, tenant_id: str = TenantId,
                       name: str = AliasName) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.write() as session:
            row = await _alias_or_404(session, alias)
            dropped = split_of(row)
            if dropped:
                row.split = None
            elif not row.previous_adapter_id:
                raise ApiError(409, f"alias {alias} has no previous adapter to roll back to", code="no_previous")
            else:
                row.adapter_id, row.previous_adapter_id = row.previous_adapter_id, row.adapter_id
            row.updated_at = utcnow()
            audit.record(session, request, "alias.rollback", "alias", alias, adapter_id=row.adapter_id,
                         previous_adapter_id=row.previous_adapter_id, dropped_split=dropped)
            await _end_rollout(session, request, alias, "alias.rollback")
            await ctx.db.bump(session)
            out = _out(row)
        await ctx.wait_for_routers()
        return out

    @delete("/{tenant_id:str}/{name:str}", status_code=204, responses=errors(404),
            summary="Delete the alias (its adapters stay; the router answers 404 for the name)")
    async def delete_alias(self, ctx: RegistryContext, request: Request, tenant_id: str = TenantId,
                           name: str = AliasName) -> None:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.write() as session:
            row = await _alias_or_404(session, alias)
            audit.record(session, request, "alias.delete", "alias", alias, adapter_id=row.adapter_id,
                         previous_adapter_id=row.previous_adapter_id, split=split_of(row))
            await _end_rollout(session, request, alias, "alias.delete")
            await session.delete(row)
            await ctx.db.bump(session)
        await ctx.wait_for_routers()

    @get("/{tenant_id:str}/{name:str}", responses=errors(404), summary="One alias")
    async def get_alias(self, ctx: RegistryContext, tenant_id: str = TenantId, name: str = AliasName) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.read() as session:
            row = await _alias_or_404(session, alias)
            rollout = await running_rollout(session, alias)
        return _out(row, rollout)

    @get("/{tenant_id:str}/{name:str}/metrics", responses=errors(404),
         summary="Per-version traffic of the alias (requests, errors by kind, TTFT, tokens, finish reasons, "
                 "cancels) from the routers' pushed windows")
    async def metrics(
        self, ctx: RegistryContext, request: Request, tenant_id: str = TenantId, name: str = AliasName,
        since: datetime | None = Parameter(query="since", default=None, required=False,
                                           description="from this time (ISO 8601)"),
        window_s: float | None = Parameter(query="window_s", default=None, gt=0, le=7 * 86400, required=False,
                                           description="over the last this many seconds (default 300)"),
        rollout_step: bool = Parameter(query="rollout_step", default=False, required=False,
                                       description="since the running rollout's current step began"),
    ) -> AliasMetricsOut:
        from registry.rollout import version_counts

        reject_unknown_query(request, "since", "window_s", "rollout_step")
        alias = f"{tenant_id}/{name}"
        now = utcnow()
        async with ctx.db.read() as session:
            await _alias_or_404(session, alias)
            start = now - timedelta(seconds=window_s or 300.0)
            if since is not None:
                start = as_utc(since)
            if rollout_step:
                r = await running_rollout(session, alias)
                if r is None:
                    raise ApiError(404, f"no rollout is running on {alias}", code="rollout_not_found")
                start = as_utc(r.step_started_at)
            counts = await version_counts(session, alias, start)
        return AliasMetricsOut(alias=alias, since=start, until=now,
                               versions={a: c.summary() for a, c in sorted(counts.items())})

    @get("/", responses=errors(), summary="List aliases (optionally of one tenant)")
    async def list_aliases(
        self, ctx: RegistryContext, request: Request,
        tenant_id: str | None = Parameter(query="tenant_id", default=None, max_length=63),
    ) -> list[AliasOut]:
        reject_unknown_query(request, "tenant_id")
        async with ctx.db.read() as session:
            q = select(Alias).order_by(Alias.alias)
            if tenant_id:
                q = q.where(Alias.tenant_id == tenant_id)
            rows = (await session.execute(q)).scalars().all()
            running = {r.active_alias: r for r in (await session.execute(
                select(Rollout).where(Rollout.active_alias.is_not(None)))).scalars().all()}
        return [_out(r, running.get(r.alias)) for r in rows]
