"""`GET /internal/audit`: the audit trail (newest first), filtered by target, kind or action."""

from __future__ import annotations

from litestar import Controller, Request, get
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy import select

from registry.context import RegistryContext
from registry.controllers.common import admin_guard, errors, get_ctx, reject_unknown_query
from registry.schemas import AuditOut
from registry.tables import AuditEntry, as_utc


class AuditController(Controller):
    path = "/internal/audit"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["audit"]

    @get("/", responses=errors(), summary="Who changed which tenant, key, adapter or alias, and when (newest first)")
    async def list_audit(
        self, ctx: RegistryContext, request: Request,
        target: str | None = Parameter(query="target", default=None, max_length=255),
        target_kind: str | None = Parameter(query="target_kind", default=None, max_length=16),
        action: str | None = Parameter(query="action", default=None, max_length=32),
        limit: int = Parameter(query="limit", default=100, ge=1, le=10_000),
    ) -> list[AuditOut]:
        reject_unknown_query(request, "target", "target_kind", "action", "limit")
        q = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
        if target:
            q = q.where(AuditEntry.target == target)
        if target_kind:
            q = q.where(AuditEntry.target_kind == target_kind)
        if action:
            q = q.where(AuditEntry.action == action)
        async with ctx.db.read() as session:
            rows = (await session.execute(q)).scalars().all()
        return [AuditOut(id=r.id, at=as_utc(r.at), actor=r.actor, client=r.client, action=r.action,
                         target_kind=r.target_kind, target=r.target, detail=dict(r.detail or {})) for r in rows]
