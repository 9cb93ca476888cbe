"""Foreign workers (`/internal/workers/{name}`: PUT registers or updates, DELETE removes) and
latency-critical models (`POST /internal/models/critical` `{model, critical}` marks or unmarks). Both appear
in the routing table the router polls; a worker's secret never reaches the registry (only the name
of the router's environment variable that holds it)."""

from __future__ import annotations

from litestar import Controller, delete, get, post, put
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy import select

from registry.context import RegistryContext
from registry.controllers.common import admin_guard, errors, get_ctx
from registry.errors import ApiError
from registry.schemas import WORKER_NAME_PATTERN, CriticalModelIn, CriticalModelOut, WorkerIn, WorkerOut
from registry.tables import CriticalModel, Worker, as_utc, utcnow

WorkerName = Parameter(pattern=WORKER_NAME_PATTERN, description="worker name")


def worker_out(row: Worker) -> dict:
    return {"name": row.name, "url": row.url, "kind": row.kind, "api_key_env": row.api_key_env,
            "weight": row.weight, "created_at": as_utc(row.created_at)}


class WorkerController(Controller):
    path = "/internal/workers"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["workers"]

    @put("/{name:str}", status_code=200, responses=errors(), summary="Register (or update) a foreign worker")
    async def put_worker(self, ctx: RegistryContext, data: WorkerIn, name: str = WorkerName) -> WorkerOut:
        async with ctx.db.write() as session:
            row = await session.get(Worker, name)
            if row is None:
                row = Worker(name=name, url=data.url.rstrip("/"), kind=data.kind, api_key_env=data.api_key_env,
                             weight=data.weight, created_at=utcnow())
                session.add(row)
            else:
                row.url, row.kind = data.url.rstrip("/"), data.kind
                row.api_key_env, row.weight = data.api_key_env, data.weight
            await session.flush()
            await ctx.db.bump(session)
            return WorkerOut(**worker_out(row))

    @delete("/{name:str}", status_code=204, responses=errors(404), summary="Remove a foreign worker")
    async def delete_worker(self, ctx: RegistryContext, name: str = WorkerName) -> None:
        async with ctx.db.write() as session:
            row = await session.get(Worker, name)
            if row is None:
                raise ApiError(404, f"no worker {name!r}", code="worker_not_found", param="name")
            await session.delete(row)
            await ctx.db.bump(session)

    @get("/", responses=errors(), summary="The foreign workers")
    async def list_workers(self, ctx: RegistryContext) -> list[WorkerOut]:
        async with ctx.db.read() as session:
            rows = (await session.execute(select(Worker).order_by(Worker.name))).scalars().all()
        return [WorkerOut(**worker_out(r)) for r in rows]


class CriticalModelController(Controller):
    path = "/internal/models/critical"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["workers"]

    @post("/", status_code=200, responses=errors(), summary="Mark (critical: true) or unmark a model")
    async def mark(self, ctx: RegistryContext, data: CriticalModelIn) -> list[CriticalModelOut]:
        async with ctx.db.write() as session:
            row = await session.get(CriticalModel, data.model)
            if data.critical and row is None:
                session.add(CriticalModel(model=data.model, created_at=utcnow()))
                await session.flush()
                await ctx.db.bump(session)
            elif not data.critical and row is not None:
                await session.delete(row)
                await session.flush()
                await ctx.db.bump(session)
            rows = (await session.execute(select(CriticalModel).order_by(CriticalModel.model))).scalars().all()
            return [CriticalModelOut(model=r.model, created_at=as_utc(r.created_at)) for r in rows]

    @get("/", responses=errors(), summary="The latency-critical models")
    async def list_critical(self, ctx: RegistryContext) -> list[CriticalModelOut]:
        async with ctx.db.read() as session:
            rows = (await session.execute(select(CriticalModel).order_by(CriticalModel.model))).scalars().all()
        return [CriticalModelOut(model=r.model, created_at=as_utc(r.created_at)) for r in rows]
