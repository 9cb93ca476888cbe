"""Replicas join and heartbeat (marked down when unseen for replica_timeout_s); placements are
computed by rendezvous hashing over the up replicas that serve the adapter's base model."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, get, post
from litestar.di import Provide
from litestar.params import Body, Parameter
from sqlalchemy import delete, select

from lorafarm.schemas import ReplicaState
from registry import placement
from registry.context import RegistryContext
from registry.controllers.common import admin_guard, errors, get_ctx, reject_unknown_query, replica_out
from registry.errors import ApiError
from registry.schemas import REPLICA_ID_PATTERN, PlacementOut, ReplicaJoin, ReplicaOut, ReplicaPlacements
from registry.tables import Adapter, Placement, Replica, utcnow

ReplicaId = Parameter(pattern=REPLICA_ID_PATTERN, description="replica id")


class ReplicaController(Controller):
    path = "/internal/replicas"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["replicas"]

    @post("/join", status_code=200, responses=errors(), summary="A replica joins (or re-joins) the fleet")
    async def join(self, ctx: RegistryContext, data: ReplicaJoin) -> ReplicaOut:
        now = utcnow()
        async with ctx.db.write() as session:
            row = await session.get(Replica, data.replica_id)
            models = list(dict.fromkeys(data.models))
            if row is None:
                row = Replica(replica_id=data.replica_id, url=data.url, base_model_hash=data.base_model_hash,
                              models=models, capacity_weight=data.capacity_weight, status="up",
                              last_seen=now, joined_at=now)
                session.add(row)
                changed = True
            else:
                changed = (row.url, row.base_model_hash, list(row.models or []), row.capacity_weight, row.status) != (
                    data.url, data.base_model_hash, models, data.capacity_weight, "up")
                if row.base_model_hash != data.base_model_hash:
                    await session.execute(delete(Placement).where(Placement.replica_id == row.replica_id))
                row.url, row.base_model_hash, row.models = data.url, data.base_model_hash, models
                row.capacity_weight, row.status, row.last_seen = data.capacity_weight, "up", now
            if changed:
                await ctx.db.bump(session)
            out = ReplicaOut(**replica_out(row))
        return out

    @post("/{replica_id:str}/heartbeat", status_code=200, responses=errors(404, 422),
          summary="A replica is alive; optionally with its state (adapters held per tier)")
    async def heartbeat(
        self,
        ctx: RegistryContext,
        replica_id: str = ReplicaId,
        data: Annotated[ReplicaState | None, Body(description="optional ReplicaState")] = None,
    ) -> ReplicaOut:
        if data is not None and data.replica_id != replica_id:
            raise ApiError(422, f"state is of replica {data.replica_id!r}, not {replica_id!r}", code="replica_mismatch",
                           param="replica_id")
        async with ctx.db.write() as session:
            row = await session.get(Replica, replica_id)
            if row is None:
                raise ApiError(404, f"no replica {replica_id!r}: join first", code="replica_not_found",
                               param="replica_id")
            row.last_seen = utcnow()
            if row.status != "up":
                row.status = "up"
                await ctx.db.bump(session)
            if data is not None:
                row.state = data.model_dump(mode="json")
                await _record_placements(ctx, session, row, data)
            out = ReplicaOut(**replica_out(row))
        return out

    @get("/", responses=errors(), summary="The replicas, with status up | down")
    async def list_replicas(self, ctx: RegistryContext) -> list[ReplicaOut]:
        await ctx.sweep()
        async with ctx.db.read() as session:
            rows = (await session.execute(select(Replica).order_by(Replica.replica_id))).scalars().all()
        return [ReplicaOut(**replica_out(r)) for r in rows]


async def _record_placements(ctx: RegistryContext, session, replica: Replica, state: ReplicaState) -> None:
    """Keep the placements table in step with what the replica reports holding (tier gpu | ram)."""
    tiers = {a: "ram" for a in state.ram_adapters}
    tiers.update({a: "gpu" for a in state.gpu_adapters})
    stored = {
        p.adapter_id: p
        for p in (await session.execute(select(Placement).where(Placement.replica_id == replica.replica_id))).scalars()
    }
    gone = [a for a in stored if a not in tiers]
    if gone:
        await session.execute(
            delete(Placement).where(Placement.replica_id == replica.replica_id, Placement.adapter_id.in_(gone))
        )
    new_ids = [a for a in tiers if a not in stored]
    if new_ids:
        adapters = {
            a.adapter_id: a
            for a in (await session.execute(select(Adapter).where(Adapter.adapter_id.in_(new_ids)))).scalars()
        }
        replicas = (await session.execute(select(Replica))).scalars().all()
        for adapter_id in new_ids:
            adapter = adapters.get(adapter_id)
            if adapter is None:
                continue  # not (or no longer) registered here
            cands = placement.eligible(replicas, adapter.base_model_hash)
            role = "owner" if replica.replica_id in placement.owners_for(adapter_id, adapter.owners_k, cands) else "spill"
            session.add(Placement(adapter_id=adapter_id, replica_id=replica.replica_id, role=role,
                                  tier=tiers[adapter_id], last_used_at=utcnow()))
    now = utcnow()
    for adapter_id, p in stored.items():
        if adapter_id in tiers:
            if p.tier != tiers[adapter_id]:
                p.tier = tiers[adapter_id]
            if tiers[adapter_id] == "gpu":
                p.last_used_at = now


class PlacementController(Controller):
    path = "/internal/placements"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["placements"]

    @get("/{adapter_id:str}", responses=errors(404), summary="The owners of an adapter (rendezvous hashing)")
    async def adapter_owners(
        self, ctx: RegistryContext, adapter_id: str = Parameter(max_length=128, description="adapter id")
    ) -> PlacementOut:
        await ctx.sweep()
        async with ctx.db.read() as session:
            adapter = await session.get(Adapter, adapter_id)
            if adapter is None:
                raise ApiError(404, f"no adapter {adapter_id}", code="adapter_not_found", param="adapter_id")
            replicas = (await session.execute(select(Replica))).scalars().all()
        cands = placement.eligible(replicas, adapter.base_model_hash)
        owners = placement.owners_for(adapter_id, adapter.owners_k, cands)
        return PlacementOut(adapter_id=adapter_id, k=len(owners), owners=owners)

    @get("/", responses=errors(404), summary="The adapters a replica owns")
    async def replica_adapters(
        self, ctx: RegistryContext, request: Request,
        replica_id: str = Parameter(query="replica_id", pattern=REPLICA_ID_PATTERN),
    ) -> ReplicaPlacements:
        reject_unknown_query(request, "replica_id")
        await ctx.sweep()
        async with ctx.db.read() as session:
            replicas = (await session.execute(select(Replica))).scalars().all()
            me = next((r for r in replicas if r.replica_id == replica_id), None)
            if me is None:
                raise ApiError(404, f"no replica {replica_id!r}", code="replica_not_found", param="replica_id")
            rows = (
                await session.execute(
                    select(Adapter.adapter_id, Adapter.owners_k).where(
                        Adapter.base_model_hash == me.base_model_hash, Adapter.status == "active"
                    ).order_by(Adapter.adapter_id)
                )
            ).all()
        cands = placement.eligible(replicas, me.base_model_hash)
        if replica_id not in cands:
            return ReplicaPlacements(replica_id=replica_id, adapters=[])
        mine = [a for a, k in rows if replica_id in placement.owners_for(a, k, cands)]
        return ReplicaPlacements(replica_id=replica_id, adapters=mine)
