"""Rollouts: POST starts a progressive deploy of a new version on an alias (the registry's
RolloutDriver then steps, promotes or rolls it back: registry/rollout.py), GET reads them,
POST .../abort stops one (all traffic back to the old version). One running rollout per alias."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy import select

from registry import rollout as rollouts
from registry.context import RegistryContext
from registry.controllers.common import admin_guard, errors, get_ctx, reject_unknown_query
from registry.errors import ApiError
from registry.schemas import RolloutCreate, RolloutOut
from registry.tables import Rollout

STATES = ("running", "promoted", "rolled_back", "aborted")
# a string, checked here: a malformed id is a 404 like an unknown one (and the admin guard runs first)
RolloutId = Parameter(max_length=32, description="the rollout's id (an integer)")


async def _rollout_or_404(session, rollout_id: str) -> Rollout:
    r = None
    if rollout_id.isascii() and rollout_id.isdigit() and int(rollout_id) < 2**31:
        r = await session.get(Rollout, int(rollout_id))
    if r is None:
        raise ApiError(404, f"no rollout {rollout_id[:32]}", code="rollout_not_found")
    return r


class RolloutController(Controller):
    path = "/internal/rollouts"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["rollouts"]

    @post("/", status_code=201, responses=errors(404, 409, 422),
          summary="Start a progressive rollout of a new version on an alias (steps, interval, bounds)")
    async def create(self, ctx: RegistryContext, request: Request, data: RolloutCreate) -> Response[RolloutOut]:
        async with ctx.db.write() as session:
            r = await rollouts.start(ctx, session, request, data)
            out = RolloutOut(**rollouts.rollout_out(r))
        await ctx.wait_for_routers()  # read-your-writes: the first step's split is in use when this returns
        return Response(out, status_code=201)

    @get("/", responses=errors(), summary="Rollouts, newest first (optionally of one alias, in one state)")
    async def list_rollouts(
        self, ctx: RegistryContext, request: Request,
        alias: str | None = Parameter(query="alias", default=None, max_length=255),
        rollout_state: str | None = Parameter(query="state", default=None, max_length=16),
        limit: int = Parameter(query="limit", default=100, ge=1, le=1000),
    ) -> list[RolloutOut]:
        reject_unknown_query(request, "alias", "state", "limit")
        state = rollout_state
        if state is not None and state not in STATES:
            raise ApiError(400, f"state must be one of {', '.join(STATES)}", code="validation_error", param="state")
        async with ctx.db.read() as session:
            q = select(Rollout).order_by(Rollout.rollout_id.desc()).limit(limit)
            if alias:
                q = q.where(Rollout.alias == alias)
            if state:
                q = q.where(Rollout.state == state)
            rows = (await session.execute(q)).scalars().all()
        return [RolloutOut(**rollouts.rollout_out(r)) for r in rows]

    @get("/{rollout_id:str}", responses=errors(404), summary="One rollout: its step, state and last evaluation")
    async def get_rollout(self, ctx: RegistryContext, rollout_id: str = RolloutId) -> RolloutOut:
        async with ctx.db.read() as session:
            r = await _rollout_or_404(session, rollout_id)
        return RolloutOut(**rollouts.rollout_out(r))

    @post("/{rollout_id:str}/abort", status_code=200, responses=errors(404, 409),
          summary="Stop a running rollout: all traffic back to the old version")
    async def abort(self, ctx: RegistryContext, request: Request, rollout_id: str = RolloutId) -> RolloutOut:
        async with ctx.db.write() as session:
            r = await _rollout_or_404(session, rollout_id)
            if r.state != "running":
                raise ApiError(409, f"rollout {rollout_id} is {r.state} already", code="rollout_finished")
            r = await rollouts.abort(ctx, session, request, r)
            out = RolloutOut(**rollouts.rollout_out(r))
        await ctx.wait_for_routers()
        return out
