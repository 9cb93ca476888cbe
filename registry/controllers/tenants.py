"""Tenants and their API keys; `POST /internal/auth/verify` for the router."""

from __future__ import annotations

import hashlib
import secrets

from litestar import Controller, Request, delete, get, patch, post
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from registry import audit
from registry.context import RegistryContext
from registry.controllers.common import admin_guard, errors, get_ctx
from registry.errors import ApiError
from registry.schemas import (
    TENANT_ID_PATTERN,
    KeyCreated,
    KeyRotated,
    KeyOut,
    TenantCreate,
    TenantCreated,
    TenantLimits,
    TenantOut,
    VerifyRequest,
    VerifyResult,
)
from registry.tables import ApiKey, Tenant, as_utc, utcnow

KEY_PREFIX = "lf-"
TenantId = Parameter(pattern=TENANT_ID_PATTERN, description="tenant id")


def hash_key(api_key: str) -> str:
    """API keys are 256-bit random strings: a plain sha256 is a safe, fast lookup hash for them."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_key(tenant_id: str) -> tuple[ApiKey, str]:
    api_key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        key_id="key-" + secrets.token_hex(8),
        tenant_id=tenant_id,
        key_hash=hash_key(api_key),
        prefix=api_key[:10],
    )
    return row, api_key


async def _tenant(session, tenant_id: str) -> Tenant:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise ApiError(404, f"no tenant {tenant_id!r}", code="tenant_not_found", param="tenant_id")
    return tenant


class TenantController(Controller):
    path = "/internal/tenants"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["tenants"]

    @post("/", status_code=201, responses=errors(409), summary="Create a tenant and its first API key (shown once)")
    async def create_tenant(self, ctx: RegistryContext, request: Request, data: TenantCreate) -> TenantCreated:
        try:
            async with ctx.db.write() as session:
                if await session.get(Tenant, data.name) is not None:
                    raise ApiError(409, f"tenant {data.name!r} already exists", code="tenant_exists", param="name")
                session.add(Tenant(tenant_id=data.name, requests_per_s=data.requests_per_s, tokens_per_s=data.tokens_per_s,
                                   weight=data.weight))
                await session.flush()
                key, api_key = new_key(data.name)
                session.add(key)
                audit.record(session, request, "tenant.create", "tenant", data.name, key_id=key.key_id,
                             requests_per_s=data.requests_per_s, tokens_per_s=data.tokens_per_s, weight=data.weight)
        except IntegrityError:
            raise ApiError(409, f"tenant {data.name!r} already exists", code="tenant_exists", param="name") from None
        return TenantCreated(tenant_id=data.name, api_key=api_key, key_id=key.key_id)

    @get("/", responses=errors(), summary="List tenants")
    async def list_tenants(self, ctx: RegistryContext) -> list[TenantOut]:
        async with ctx.db.read() as session:
            rows = (await session.execute(select(Tenant).order_by(Tenant.tenant_id))).scalars().all()
        return [
            TenantOut(tenant_id=t.tenant_id, requests_per_s=t.requests_per_s, tokens_per_s=t.tokens_per_s,
                      weight=t.weight, created_at=as_utc(t.created_at))
            for t in rows
        ]

    @patch("/{tenant_id:str}", responses=errors(404), summary="Change a tenant's rate limits (null: unlimited) or fair-scheduling weight (null: 1)")
    async def set_limits(self, ctx: RegistryContext, request: Request, data: TenantLimits,
                         tenant_id: str = TenantId) -> TenantOut:
        changes = {f: getattr(data, f) for f in data.model_fields_set}
        if not changes:
            raise ApiError(400, "send requests_per_s, tokens_per_s and/or weight", code="validation_error")
        async with ctx.db.write() as session:
            t = await _tenant(session, tenant_id)
            before = {f: getattr(t, f) for f in changes}
            for f, v in changes.items():
                setattr(t, f, v)
            audit.record(session, request, "tenant.set_limits", "tenant", tenant_id, before=before, after=changes)
            await ctx.db.bump(session)  # routers re-read the tenant's limits (auth cache) at their next poll
            out = TenantOut(tenant_id=t.tenant_id, requests_per_s=t.requests_per_s, tokens_per_s=t.tokens_per_s,
                            weight=t.weight, created_at=as_utc(t.created_at))
        return out

    @post("/{tenant_id:str}/keys", status_code=201, responses=errors(404), summary="Create an API key (shown once)")
    async def create_key(self, ctx: RegistryContext, request: Request, tenant_id: str = TenantId) -> KeyCreated:
        async with ctx.db.write() as session:
            await _tenant(session, tenant_id)
            key, api_key = new_key(tenant_id)
            session.add(key)
            audit.record(session, request, "key.create", "key", key.key_id, tenant_id=tenant_id)
        return KeyCreated(key_id=key.key_id, api_key=api_key)

    @post("/{tenant_id:str}/keys/rotate", status_code=201, responses=errors(404, 409),
          summary="Rotate: issue a new key and revoke the given one (key_id query) or every live key")
    async def rotate_keys(self, ctx: RegistryContext, request: Request, tenant_id: str = TenantId,
                          key_id: str | None = Parameter(query="key_id", default=None, max_length=64)) -> KeyRotated:
        async with ctx.db.write() as session:
            await _tenant(session, tenant_id)
            live = (await session.execute(
                select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None)).order_by(ApiKey.key_id)
            )).scalars().all()
            if key_id is not None:
                live = [k for k in live if k.key_id == key_id]
                if not live:
                    old = await session.get(ApiKey, key_id)
                    if old is None or old.tenant_id != tenant_id:
                        raise ApiError(404, f"tenant {tenant_id!r} has no key {key_id!r}", code="key_not_found",
                                       param="key_id")
                    raise ApiError(409, f"key {key_id} is already revoked: nothing to rotate "
                                   "(create a new key instead)", code="key_revoked", param="key_id")
            now = utcnow()
            for k in live:
                k.revoked_at = now
            key, api_key = new_key(tenant_id)
            session.add(key)
            revoked = [k.key_id for k in live]
            audit.record(session, request, "key.rotate", "key", key.key_id, tenant_id=tenant_id, revoked=revoked)
            if revoked:
                await ctx.db.bump(session)  # routers drop revoked keys from their auth caches at their next poll
        if revoked:  # read-your-writes, as for alias deploys: every router refuses the old keys when this returns
            await ctx.wait_for_routers()
        return KeyRotated(key_id=key.key_id, api_key=api_key, revoked_key_ids=revoked)

    @get("/{tenant_id:str}/keys", responses=errors(404), summary="List a tenant's keys (prefixes only)")
    async def list_keys(self, ctx: RegistryContext, tenant_id: str = TenantId) -> list[KeyOut]:
        async with ctx.db.read() as session:
            await _tenant(session, tenant_id)
            rows = (
                await session.execute(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at))
            ).scalars().all()
        return [
            KeyOut(key_id=k.key_id, prefix=k.prefix, created_at=as_utc(k.created_at), revoked_at=as_utc(k.revoked_at))
            for k in rows
        ]

    @delete("/{tenant_id:str}/keys/{key_id:str}", status_code=204, responses=errors(404), summary="Revoke a key")
    async def revoke_key(
        self, ctx: RegistryContext, request: Request, key_id: str = Parameter(max_length=64),
        tenant_id: str = TenantId,
    ) -> None:
        async with ctx.db.write() as session:
            key = await session.get(ApiKey, key_id)
            if key is None or key.tenant_id != tenant_id:
                raise ApiError(404, f"tenant {tenant_id!r} has no key {key_id!r}", code="key_not_found")
            newly = key.revoked_at is None
            if newly:
                key.revoked_at = utcnow()
                audit.record(session, request, "key.revoke", "key", key_id, tenant_id=tenant_id)
                await ctx.db.bump(session)  # routers drop the key from their auth caches at their next poll
        if newly:  # read-your-writes, as for alias deploys: every router refuses the key when this returns
            await ctx.wait_for_routers()


class AuthController(Controller):
    path = "/internal/auth"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["tenants"]

    @post("/verify", status_code=200, responses=errors(), summary="Check a tenant API key (router)")
    async def verify(self, ctx: RegistryContext, data: VerifyRequest) -> VerifyResult:
        async with ctx.db.read() as session:
            row = (
                await session.execute(
                    select(ApiKey, Tenant)
                    .join(Tenant, Tenant.tenant_id == ApiKey.tenant_id)
                    .where(ApiKey.key_hash == hash_key(data.api_key))
                )
            ).first()
        if row is None or row[0].revoked_at is not None:
            raise ApiError(401, "invalid or revoked API key", code="invalid_api_key", param="api_key")
        key, tenant = row
        return VerifyResult(
            tenant_id=tenant.tenant_id, key_id=key.key_id,
            requests_per_s=tenant.requests_per_s, tokens_per_s=tenant.tokens_per_s, weight=tenant.weight,
        )
