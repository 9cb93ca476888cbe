"""Foreign workers (`/internal/workers/{name}`: PUT registers or updates, DELETE removes) and
latency-critical models (`POST /internal/models/critical` `{model, critical}` marks or unmarks). Both appear
in the routing table the router polls; a worker's secret never reaches the registry (only the name
of the router's environment variable that holds it, `LORAFARM_WORKER_KEY_*` only). Every change
writes an audit row (`worker.add|update|remove`, `model.critical|uncritical`) in its transaction."""

from __future__ import annotations

from litestar import Controller, Request, delete, get, post, put
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy import select

from registry import audit
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
    async def put_worker(self, ctx: RegistryContext, request: Request, data: WorkerIn,
                         name: str = WorkerName) -> WorkerOut:
        async with ctx.db.write() as session:
            row = await session.get(Worker, name)
            new = {"url": data.url.rstrip("/"), "kind": data.kind, "api_key_env": data.api_key_env,
                   "weight": data.weight}
            if row is None:
                row = Worker(name=name, **new, created_at=utcnow())
                session.add(row)
                audit.record(session, request, "worker.add", "worker", name, **new)
            else:
                old = {"url": row.url, "kind": row.kind, "api_key_env": row.api_key_env, "weight": row.weight}
                row.url, row.kind = new["url"], new["kind"]
                row.api_key_env, row.weight = new["api_key_env"], new["weight"]
                audit.record(session, request, "worker.update", "worker", name, **new,
                             previous={k: v for k, v in old.items() if new[k] != v} or None)
            await session.flush()
            await ctx.db.bump(session)
            return WorkerOut(**worker_out(row))

    @delete("/{name:str}", status_code=204, responses=errors(404), summary="Remove a foreign worker")
    async def delete_worker(self, ctx: RegistryContext, request: Request, name: str = WorkerName) -> None:
        async with ctx.db.write() as session:
            row = await session.get(Worker, name)
            if row is None:
                raise ApiError(404, f"no worker {name!r}", code="worker_not_found", param="name")
            audit.record(session, request, "worker.remove", "worker", name, url=row.url, kind=row.kind,
                         api_key_env=row.api_key_env)
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
    async def mark(self, ctx: RegistryContext, request: Request, data: CriticalModelIn) -> list[CriticalModelOut]:
        async with ctx.db.write() as session:
            row = await session.get(CriticalModel, data.model)
            if data.critical and row is None:
                session.add(CriticalModel(model=data.model, created_at=utcnow()))
                audit.record(session, request, "model.critical", "model", data.model)
                await session.flush()
                await ctx.db.bump(session)
            elif not data.critical and row is not None:
                audit.record(session, request, "model.uncritical", "model", data.model)
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
