"""Stats intake from the router (drives owner counts) and the routing table the router polls."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from litestar import Controller, Request, Response, get, post
from litestar.di import Provide
from litestar.params import Parameter
from litestar.openapi.datastructures import ResponseSpec
from sqlalchemy import delete, select

from registry import placement
from registry.context import RegistryContext
from registry.controllers.common import admin_guard, errors, get_ctx, reject_unknown_query, replica_out
from registry.controllers.workers import worker_out
from registry.schemas import RoutingAdapter, RoutingAlias, RoutingTable, StatsIn, VersionStatsIn
from registry.tables import (
    Adapter,
    AdapterStat,
    Alias,
    ApiKey,
    CriticalModel,
    RegistryState,
    Replica,
    Worker,
    as_utc,
    utcnow,
)


LONG_POLL_STEP_S = 1.0  # a held routing poll wakes at once on a write through this registry (Database.changed)
# and re-reads the version this often for writes by other registry processes sharing the database; it
# re-read every 50 ms before: 20 queries a second per router, 6% of a core on an idle farm
REVOKED_KEPT = timedelta(hours=1)  # longer than any router's auth-cache TTL


class StatsController(Controller):
    path = "/internal/stats"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["stats"]

    @post("/", status_code=204, responses=errors(413), request_max_body_size=256 * 1024**2,
          summary="Per-adapter traffic of the last window (router)")
    async def intake(self, ctx: RegistryContext, data: StatsIn) -> None:
        s = ctx.settings
        now = utcnow()
        window_start = now - timedelta(seconds=data.window_s)
        totals: dict[str, list[int]] = {}
        for w in data.adapters:
            t = totals.setdefault(w.adapter_id, [0, 0, 0])
            t[0] += w.requests
            t[1] += w.tokens
            t[2] += w.gpu_hits
        if not totals:
            return
        async with ctx.db.write() as session:
            rows = (await session.execute(select(Adapter).where(Adapter.adapter_id.in_(list(totals))))).scalars().all()
            changed = False
            for row in rows:
                requests, tokens, gpu_hits = totals[row.adapter_id]
                session.add(AdapterStat(
                    adapter_id=row.adapter_id, window_start=window_start, window_s=data.window_s, requests=requests,
                    tokens=tokens, tokens_per_s=tokens / data.window_s,
                    gpu_hit_rate=(min(gpu_hits, requests) / requests) if requests else None,
                ))
                rate = placement.add_window(row.load_tokens_per_s, as_utc(row.load_updated_at), now, tokens, s.stats_tau_s)
                new_k = placement.owner_count(rate, row.owners_k, k_min=s.owners_k,
                                              capacity=s.replica_capacity_tokens_per_s, cooldown_ratio=s.cooldown_ratio)
                row.load_tokens_per_s, row.load_updated_at = rate, now
                if new_k != row.owners_k:
                    row.owners_k = new_k
                    changed = True
            await session.execute(
                delete(AdapterStat).where(AdapterStat.window_start < now - timedelta(seconds=s.stats_retention_s))
            )
            if changed:
                await ctx.db.bump(session)


    @post("/versions", status_code=204, responses=errors(413), request_max_body_size=64 * 1024**2,
          summary="Per-version traffic of split aliases over the last window (router): what rollouts judge")
    async def versions(self, ctx: RegistryContext, data: VersionStatsIn) -> None:
        from registry.rollout import record_windows

        if data.versions:
            await record_windows(ctx, data.window_s, data.router_id, data.versions)


class RoutingController(Controller):
    path = "/internal/routing"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["routing"]

    @get("/", responses={**errors(), 304: ResponseSpec(None, description="unchanged since If-None-Match")},
         summary="Aliases, adapters, base models and replicas in one table, with an ETag (304 when unchanged)")
    async def routing(
        self,
        ctx: RegistryContext,
        request: Request,
        wait: float | None = Parameter(query="wait", ge=0, le=60, required=False,
                                       description="long poll: hold a 304 answer up to this many seconds "
                                                   "until the table changes"),
    ) -> Response[RoutingTable]:
        reject_unknown_query(request, "wait")
        await ctx.sweep()
        inm = request.headers.get("if-none-match")
        router_id = request.headers.get("x-lorafarm-router")
        if router_id and inm:
            with contextlib.suppress(ValueError):  # what it sends is what it has applied
                ctx.router_polled(router_id, int(inm.strip().removeprefix("W/").strip('"').removeprefix("v")))
        deadline = asyncio.get_running_loop().time() + (wait or 0.0)
        while True:
            version = await ctx.db.version()
            etag = f'"v{version}"'
            if not (inm and (inm.strip() == "*" or etag in [t.strip().removeprefix("W/") for t in inm.split(",")])):
                break
            if asyncio.get_running_loop().time() >= deadline:
                return Response(None, status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
            try:
                await ctx.db.changed(min(LONG_POLL_STEP_S, max(0.0, deadline - asyncio.get_running_loop().time())))
            except asyncio.CancelledError:  # the server is stopping (its 3 s grace is over): answer now
                return Response(None, status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
        async with ctx.db.read() as session:
            # The version first: content read after it is at least as new, never older.
            version = int((await session.execute(select(RegistryState.version).where(RegistryState.id == 1))).scalar_one())
            etag = f'"v{version}"'
            aliases = (await session.execute(
                select(Alias.alias, Alias.adapter_id, Alias.tenant_id, Alias.previous_adapter_id, Alias.split))).all()
            adapters = (await session.execute(
                select(Adapter.adapter_id, Adapter.tenant_id, Adapter.base_model_hash, Adapter.owners_k, Adapter.status)
            )).all()
            replicas = (await session.execute(select(Replica).order_by(Replica.replica_id))).scalars().all()
            known = await ctx.known_base_hashes(session)
            workers = (await session.execute(select(Worker).order_by(Worker.name))).scalars().all()
            critical = (await session.execute(select(CriticalModel.model).order_by(CriticalModel.model))).scalars().all()
            since = utcnow() - REVOKED_KEPT
            revoked = [
                k for k, at in (await session.execute(
                    select(ApiKey.key_id, ApiKey.revoked_at).where(ApiKey.revoked_at.is_not(None))
                )).all() if as_utc(at) > since
            ]  # fmt: skip
        base_models = {b.name: b.hash for b in ctx.base_models.values()}
        adapter_ids = {a for a, *_ in adapters}
        for r in replicas:
            for m in r.models or []:
                if m not in adapter_ids:  # a merged-mode replica names its adapter: not a base model
                    base_models.setdefault(m, r.base_model_hash)
        for h, name in known.items():
            if name and name not in base_models:
                base_models[name] = h
        cands_by_base: dict[str, int] = {}
        for r in replicas:
            if r.status == "up":
                cands_by_base[r.base_model_hash] = cands_by_base.get(r.base_model_hash, 0) + 1
        in_use = {ad for _, ad, _, _, _ in aliases} | {str(x["adapter_id"]) for *_, sp in aliases for x in sp or ()}
        retired = {p for _, _, _, p, _ in aliases if p} - in_use
        table = RoutingTable(
            version=version,
            aliases={a: RoutingAlias(adapter_id=ad, tenant_id=t, split=sp or None) for a, ad, t, _, sp in aliases},
            adapters={
                a: RoutingAdapter(tenant_id=t, base_model_hash=h, status=st, retired=a in retired,
                                  owners_k=max(1, min(k, cands_by_base.get(h, 0))) if cands_by_base.get(h) else k)
                for a, t, h, k, st in adapters
            },
            base_models=base_models,
            replicas=[replica_out(r) for r in replicas],
            rank_limit=ctx.settings.rank_limit,
            revoked_key_ids=sorted(revoked),
            workers=[worker_out(w) for w in workers],
            critical_models=list(critical),
        )
        return Response(table, headers={"ETag": etag, "Cache-Control": "no-cache"})
