"""Aliases: `<tenant_id>/<name>:<tag>` -> adapter id. PUT deploys (keeping the previous adapter),
POST .../rollback swaps back. Routes are /internal/aliases/{tenant_id}/{name}: the slash of the
alias is a path separator, so `PUT /internal/aliases/acme/support:prod` works as written."""

from __future__ import annotations

import re

from litestar import Controller, Request, delete, get, post, put
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy import select

from registry import audit
from registry.context import RegistryContext
from registry.controllers.common import admin_guard, alias_out, errors, get_ctx, reject_unknown_query
from registry.errors import ApiError
from registry.schemas import ALIAS_NAME_PATTERN, ALIAS_PATTERN, TENANT_ID_PATTERN, AliasOut, AliasSet
from registry.tables import Adapter, Alias, Tenant, utcnow

_ALIAS_RE = re.compile(ALIAS_PATTERN)
TenantId = Parameter(pattern=TENANT_ID_PATTERN, description="the alias's tenant (before the slash)")
AliasName = Parameter(pattern=ALIAS_NAME_PATTERN, description="`name:tag` (after the slash)")


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


async def apply_alias(ctx: RegistryContext, session, alias: str, adapter_id: str) -> Alias:
    """Point `alias` at `adapter_id` inside a write transaction (the caller bumps the version)."""
    owner = check_alias_name(alias)
    if await session.get(Tenant, owner) is None:
        raise ApiError(422, f"alias {alias}: no tenant {owner!r}", code="tenant_not_found", param="alias")
    adapter = await session.get(Adapter, adapter_id)
    if adapter is None:
        raise ApiError(422, f"no adapter {adapter_id}", code="adapter_not_found", param="adapter_id")
    if adapter.tenant_id != owner:
        raise ApiError(422, f"adapter {adapter_id} belongs to tenant {adapter.tenant_id!r}; alias {alias} "
                       f"belongs to {owner!r}", code="alias_not_owned", param="adapter_id")
    row = await session.get(Alias, alias)
    if row is None:
        row = Alias(alias=alias, tenant_id=owner, adapter_id=adapter_id, previous_adapter_id=None, updated_at=utcnow())
        session.add(row)
    elif row.adapter_id != adapter_id:
        row.previous_adapter_id = row.adapter_id
        row.adapter_id = adapter_id
        row.updated_at = utcnow()
    await session.flush()
    return row


async def _alias_or_404(session, alias: str) -> Alias:
    row = await session.get(Alias, alias)
    if row is None:
        raise ApiError(404, f"no alias {alias}", code="alias_not_found", param="alias")
    return row


class AliasController(Controller):
    path = "/internal/aliases"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["aliases"]

    @put("/{tenant_id:str}/{name:str}", responses=errors(422),
         summary="Deploy: point the alias <tenant_id>/<name> at an adapter (keeps the previous one)")
    async def set_alias(
        self, ctx: RegistryContext, request: Request, data: AliasSet, tenant_id: str = TenantId,
        name: str = AliasName,
    ) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.write() as session:
            before = await session.get(Alias, alias)
            previous = before.adapter_id if before is not None else None
            row = await apply_alias(ctx, session, alias, data.adapter_id)
            if previous != data.adapter_id:
                audit.record(session, request, "alias.set", "alias", alias, adapter_id=data.adapter_id,
                             previous_adapter_id=previous)
                await ctx.db.bump(session)
            out = AliasOut(**alias_out(row))
        await ctx.wait_for_routers()  # read-your-writes: routers serve the new target when this returns
        return out

    @post("/{tenant_id:str}/{name:str}/rollback", status_code=200, responses=errors(404, 409),
          summary="Roll back: swap the alias with its previous adapter")
    async def rollback(self, ctx: RegistryContext, request: Request, tenant_id: str = TenantId,
                       name: str = AliasName) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.write() as session:
            row = await _alias_or_404(session, alias)
            if not row.previous_adapter_id:
                raise ApiError(409, f"alias {alias} has no previous adapter to roll back to", code="no_previous")
            row.adapter_id, row.previous_adapter_id = row.previous_adapter_id, row.adapter_id
            row.updated_at = utcnow()
            audit.record(session, request, "alias.rollback", "alias", alias, adapter_id=row.adapter_id,
                         previous_adapter_id=row.previous_adapter_id)
            await ctx.db.bump(session)
            out = AliasOut(**alias_out(row))
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
                         previous_adapter_id=row.previous_adapter_id)
            await session.delete(row)
            await ctx.db.bump(session)
        await ctx.wait_for_routers()

    @get("/{tenant_id:str}/{name:str}", responses=errors(404), summary="One alias")
    async def get_alias(self, ctx: RegistryContext, tenant_id: str = TenantId, name: str = AliasName) -> AliasOut:
        alias = f"{tenant_id}/{name}"
        async with ctx.db.read() as session:
            row = await _alias_or_404(session, alias)
        return AliasOut(**alias_out(row))

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
        return [AliasOut(**alias_out(r)) for r in rows]
