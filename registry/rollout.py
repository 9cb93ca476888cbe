"""Progressive rollouts, run by the registry: state in the `rollouts` table, traffic figures in
`version_stats` (pushed by every router), the decision in `registry/rollout_policy.py`.

`RolloutDriver.run_forever()` (started by the app's lifespan) ticks every `rollout_tick_s`: for each
running rollout it sums the routers' windows of the old and the new version since the step began,
asks `decide()`, and applies the answer in one write transaction: the next step's split, the
promotion (the alias points at the new version alone, the old one is its previous), or the rollback
(all traffic back to the old version), each with an audit row; a rollback also logs a warning naming
the breached bound. Because all of it lives in the database, a router restart loses at most one
unpushed stats window, and a registry restart resumes the rollout where it was (several registry
processes on one database apply each transition once: the write lock serializes them and the step
is re-checked inside the transaction).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update

from lorafarm.client.summary import VersionCounts
from registry import audit
from registry.alias_ops import check_owner, check_target, finish_rollout, running_rollout, set_single, set_split, split_of
from registry.errors import ApiError
from registry.rollout_policy import ADVANCE, HOLD, PROMOTE, ROLLBACK, Bounds, check_steps, decide
from registry.tables import Alias, Rollout, VersionStat, as_utc, utcnow

log = logging.getLogger("lorafarm.registry.rollout")
EVALUATION_SAVE_S = 5.0  # a held rollout's last evaluation is written at most this often


def rollout_out(r: Rollout) -> dict:
    steps = [int(s) for s in r.steps or []]
    if r.state == "running":
        percent = steps[r.step_index] if r.step_index < len(steps) else 100
    else:
        percent = 100 if r.state == "promoted" else 0
    return {
        "rollout_id": r.rollout_id, "alias": r.alias, "tenant_id": r.tenant_id, "old_adapter_id": r.old_adapter_id,
        "new_adapter_id": r.new_adapter_id, "steps": steps, "interval_s": r.interval_s, "bounds": dict(r.bounds or {}),
        "step_index": r.step_index, "percent": percent, "step_started_at": as_utc(r.step_started_at),
        "state": r.state, "reason": r.reason, "breached": r.breached,
        "last_evaluation": dict(r.last_evaluation or {}), "actor": r.actor, "created_at": as_utc(r.created_at),
        "finished_at": as_utc(r.finished_at),
    }  # fmt: skip


def step_split(r: Rollout, percent: int) -> list[dict]:
    return [{"adapter_id": r.old_adapter_id, "weight": float(100 - percent)},
            {"adapter_id": r.new_adapter_id, "weight": float(percent)}]


async def version_counts(session, alias: str, since: datetime) -> dict[str, VersionCounts]:
    """adapter id -> its counts summed over the windows of `alias` that ended after `since`."""
    rows = (await session.execute(
        select(VersionStat.adapter_id, VersionStat.counts)
        .where(VersionStat.alias == alias, VersionStat.window_end > since)
    )).all()  # fmt: skip
    out: dict[str, VersionCounts] = {}
    for adapter_id, counts in rows:
        out.setdefault(adapter_id, VersionCounts()).merge(VersionCounts.from_wire(counts or {}))
    return out


async def record_windows(ctx, window_s: float, router_id: str | None, versions: list) -> None:
    """POST /internal/stats/versions: one row per (alias, version) window; old rows pruned."""
    now = utcnow()
    start = now - timedelta(seconds=window_s)
    async with ctx.db.write() as session:
        for v in versions:
            counts = VersionCounts.from_wire(v.model_dump())
            session.add(VersionStat(alias=v.alias, adapter_id=v.adapter_id, window_start=start, window_end=now,
                                    router_id=router_id, counts=counts.to_wire()))
        await session.execute(delete(VersionStat).where(
            VersionStat.window_end < now - timedelta(seconds=ctx.settings.version_stats_retention_s)))


async def start(ctx, session, request, data) -> Rollout:
    """Create a rollout and put its first step's split on the alias (inside a write transaction)."""
    alias = data.alias
    owner = await check_owner(session, alias)
    try:
        steps = check_steps(data.steps)
        bounds = Bounds.from_dict({k: v for k, v in (data.bounds.model_dump() if data.bounds else {}).items()
                                   if v is not None})
    except ValueError as e:
        raise ApiError(422, str(e), code="invalid_rollout") from None
    row = await session.get(Alias, alias)
    if row is None:
        raise ApiError(404, f"no alias {alias}: deploy a first version with `aliases set` (a rollout needs one to "
                       "compare with)", code="alias_not_found", param="alias")
    running = await running_rollout(session, alias)
    if running is not None:
        raise ApiError(409, f"rollout {running.rollout_id} is already running on {alias} "
                       f"({running.new_adapter_id} at {rollout_out(running)['percent']}%): one rollout per alias",
                       code="rollout_running")
    if row.split:
        raise ApiError(409, f"alias {alias} already splits its traffic: promote or roll back that split first",
                       code="alias_split")
    if row.adapter_id == data.adapter_id:
        raise ApiError(422, f"{data.adapter_id} already gets all of {alias}'s traffic", code="already_deployed",
                       param="adapter_id")
    await check_target(session, alias, owner, data.adapter_id, active=True)
    actor, _ = audit.who(request)
    now = utcnow()
    r = Rollout(alias=alias, active_alias=alias, tenant_id=owner, old_adapter_id=row.adapter_id,
                new_adapter_id=data.adapter_id, steps=steps, interval_s=float(data.interval_s), bounds=bounds.to_dict(),
                step_index=0, step_started_at=now, state="running", reason=None, breached=None, last_evaluation={},
                actor=actor, created_at=now, updated_at=now)
    session.add(r)
    await session.flush()
    await set_split(session, alias, step_split(r, steps[0]), stable=r.old_adapter_id)
    audit.record(session, request, "rollout.start", "alias", alias, rollout_id=r.rollout_id,
                 old_adapter_id=r.old_adapter_id, new_adapter_id=r.new_adapter_id, steps=steps,
                 interval_s=r.interval_s, bounds=r.bounds)
    await ctx.db.bump(session)
    log.info("rollout %d of %s started by %s: %s -> %s, steps %s every %g s", r.rollout_id, alias, actor,
             r.old_adapter_id, r.new_adapter_id, ",".join(map(str, steps)), r.interval_s)
    return r


async def abort(ctx, session, request, r: Rollout) -> Rollout:
    """POST /internal/rollouts/{id}/abort: all traffic back to the old version."""
    actor, _ = audit.who(request)
    row = await session.get(Alias, r.alias)
    if row is not None and split_of(row):
        row.split = None
        row.adapter_id = r.old_adapter_id
        row.updated_at = utcnow()
    finish_rollout(r, "aborted", f"aborted by {actor}")
    audit.record(session, request, "rollout.abort", "alias", r.alias, rollout_id=r.rollout_id,
                 adapter_id=r.old_adapter_id, new_adapter_id=r.new_adapter_id)
    await ctx.db.bump(session)
    return r


def _actor(r: Rollout) -> str:
    return f"rollout {r.rollout_id} (started by {r.actor})"


class RolloutDriver:
    def __init__(self, ctx):
        self.ctx = ctx
        self._saved_at: dict[int, float] = {}

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.settings.rollout_tick_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep driving: a database hiccup must not strand the rollouts
                log.exception("rollout tick failed")

    async def tick(self) -> int:
        """Evaluate every running rollout once; returns how many changed state or step."""
        ctx = self.ctx
        now = utcnow()
        async with ctx.db.read() as session:
            running = (await session.execute(select(Rollout).where(Rollout.state == "running"))).scalars().all()
            work = []
            for r in running:
                counts = await version_counts(session, r.alias, as_utc(r.step_started_at))
                work.append((r, counts))
        changed = 0
        for r, counts in work:
            elapsed = (now - as_utc(r.step_started_at)).total_seconds()
            d = decide(steps=[int(s) for s in r.steps], step_index=r.step_index, elapsed_s=elapsed,
                       interval_s=r.interval_s, old=counts.get(r.old_adapter_id, VersionCounts()),
                       new=counts.get(r.new_adapter_id, VersionCounts()), bounds=Bounds.from_dict(r.bounds))
            if d.action == HOLD:
                last = self._saved_at.get(r.rollout_id, 0.0)
                if time.monotonic() - last >= EVALUATION_SAVE_S:
                    self._saved_at[r.rollout_id] = time.monotonic()
                    await self._save_evaluation(r.rollout_id, r.step_index, d, now)
                continue
            if await self._apply(r.rollout_id, r.step_index, d, now):
                changed += 1
        if changed:
            await ctx.wait_for_routers()
        return changed

    @staticmethod
    async def _claim(session, rollout_id: int, step_index: int, now: datetime) -> Rollout | None:
        """Compare and set, first thing in the write transaction: the rollout is still running at
        `step_index`, and this transaction now holds the write lock on it (SQLite's too: its reads
        run outside any snapshot otherwise), so what it reads next is not changed under it."""
        claimed = await session.execute(
            update(Rollout).where(Rollout.rollout_id == rollout_id, Rollout.state == "running",
                                  Rollout.step_index == step_index).values(updated_at=now)
            .execution_options(synchronize_session=False))
        if claimed.rowcount != 1:
            return None  # another registry process (or a change by hand) got there first
        return await session.get(Rollout, rollout_id)

    async def _save_evaluation(self, rollout_id: int, step_index: int, d, now: datetime) -> None:
        async with self.ctx.db.write() as session:
            r = await self._claim(session, rollout_id, step_index, now)
            if r is None:
                return
            r.last_evaluation = {"at": now.isoformat(), "action": d.action, "reason": d.reason, **_jsonable(d.figures)}

    async def _apply(self, rollout_id: int, step_index: int, d, now: datetime) -> bool:
        ctx = self.ctx
        async with ctx.db.write() as session:
            r = await self._claim(session, rollout_id, step_index, now)
            if r is None:
                return False
            r.last_evaluation = {"at": now.isoformat(), "action": d.action, "reason": d.reason, **_jsonable(d.figures)}
            r.updated_at = now
            alias = await session.get(Alias, r.alias)
            ids = {t["adapter_id"] for t in split_of(alias) or ()}
            if alias is None or alias.adapter_id != r.old_adapter_id or r.new_adapter_id not in ids:
                finish_rollout(r, "aborted", "the alias was changed outside the rollout")
                audit.record_as(session, _actor(r), None, "rollout.abort", "alias", r.alias, rollout_id=r.rollout_id,
                                reason=r.reason)
                log.warning("rollout %d of %s aborted: the alias was changed outside the rollout", r.rollout_id, r.alias)
                return True
            steps = [int(s) for s in r.steps]
            if d.action == ROLLBACK:
                alias.split = None  # adapter_id is the old version: all traffic back to it
                alias.updated_at = now
                finish_rollout(r, "rolled_back", d.reason, d.breached)
                audit.record_as(session, _actor(r), None, "rollout.rollback", "alias", r.alias,
                                rollout_id=r.rollout_id, adapter_id=r.old_adapter_id,
                                rolled_back_adapter_id=r.new_adapter_id, percent=steps[r.step_index],
                                breached=d.breached, reason=d.reason, figures=_jsonable(d.figures))
                log.warning("rollout %d of %s ROLLED BACK (bound breached: %s): %s -> all traffic on %s again; %s",
                            r.rollout_id, r.alias, d.breached, r.new_adapter_id, r.old_adapter_id, d.reason)
            elif d.action == PROMOTE:
                await set_single(session, r.alias, r.new_adapter_id)
                finish_rollout(r, "promoted", d.reason)
                audit.record_as(session, _actor(r), None, "rollout.promote", "alias", r.alias,
                                rollout_id=r.rollout_id, adapter_id=r.new_adapter_id,
                                previous_adapter_id=r.old_adapter_id, reason=d.reason)
                log.info("rollout %d of %s promoted %s to 100%%: %s", r.rollout_id, r.alias, r.new_adapter_id, d.reason)
            elif d.action == ADVANCE:
                r.step_index += 1
                r.step_started_at = now
                percent = steps[r.step_index]
                await set_split(session, r.alias, step_split(r, percent), stable=r.old_adapter_id)
                audit.record_as(session, _actor(r), None, "rollout.step", "alias", r.alias, rollout_id=r.rollout_id,
                                adapter_id=r.new_adapter_id, percent=percent, reason=d.reason)
                log.info("rollout %d of %s: %s now at %d%% (%s)", r.rollout_id, r.alias, r.new_adapter_id, percent,
                         d.reason)
            await ctx.db.bump(session)
        return True


def _jsonable(value):
    """Figures for a JSON column: floats rounded, NaN/inf as None."""
    import math

    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    return value
