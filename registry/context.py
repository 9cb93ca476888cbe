"""What every handler needs, opened by the app's lifespan and kept on `app.state.registry`."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from registry import placement
from registry.db import Database
from registry.settings import RegistrySettings
from registry.tables import Adapter, Replica, as_utc, utcnow

log = logging.getLogger("lorafarm.registry")
ROUTER_TTL_S = 45.0  # a router that has not polled this long is not waited for (longer than a long poll)


@dataclass
class ServedBase:
    """A base model given with --base-model NAME=DIR: its hash, and config.json for shape checks."""

    name: str
    path: Path
    hash: str
    config: dict | None


class RegistryContext:
    """Not a dataclass on purpose: Litestar would try to validate a dataclass dependency."""

    def __init__(
        self,
        settings: RegistrySettings,
        db: Database,
        store: Any,  # archives.store.ObjectStore
        private_key: Any,  # Ed25519PrivateKey
        public_key: Any,
        trusted_keys: list | None = None,  # public keys whose archives may be registered
        base_models: dict[str, ServedBase] | None = None,
    ):
        self.settings = settings
        self.db = db
        self.store = store
        self.private_key = private_key
        self.public_key = public_key
        self.trusted_keys = list(trusted_keys or [public_key])
        self.base_models = dict(base_models or {})
        self.upload_lock = asyncio.Lock()
        # liveness is judged only on heartbeats this process could have received: a replica is not
        # "unseen" for the time the registry itself was down
        self.started_at = utcnow()
        # routers long-polling the routing table: router id -> (version it has applied, when it asked)
        self.routers: dict[str, tuple[int, float]] = {}

    # -- auth ---------------------------------------------------------------------------------

    def admin_ok(self, authorization: str | None) -> bool:
        token = self.settings.admin_token
        if not token or not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    # -- base models --------------------------------------------------------------------------

    def base_by_hash(self, base_hash: str) -> ServedBase | None:
        return next((b for b in self.base_models.values() if b.hash == base_hash), None)

    async def known_base_hashes(self, session) -> dict[str, str | None]:
        """hash -> a model name (None when only a replica knows it): configured bases and joined replicas'."""
        known: dict[str, str | None] = {b.hash: b.name for b in self.base_models.values()}
        for base_hash, models in (await session.execute(select(Replica.base_model_hash, Replica.models))).all():
            if base_hash not in known or known[base_hash] is None:
                known[base_hash] = (models or [None])[0]
        return known

    # -- periodic work ------------------------------------------------------------------------

    async def sweep(self) -> bool:
        """Mark replicas unseen for replica_timeout_s down, and re-evaluate the owner counts of
        adapters whose traffic is cooling. Returns True when the routing table changed."""
        s = self.settings
        now = utcnow()
        cutoff = now - timedelta(seconds=s.replica_timeout_s)
        async with self.db.read() as session:
            stale = [] if self.started_at > cutoff else (  # within the start-up grace nobody is stale
                await session.execute(select(Replica.replica_id).where(Replica.status == "up", Replica.last_seen < cutoff))
            ).scalars().all()
            warm = (
                await session.execute(
                    select(Adapter.adapter_id, Adapter.owners_k, Adapter.load_tokens_per_s, Adapter.load_updated_at).where(
                        (Adapter.load_tokens_per_s > 0) | (Adapter.owners_k != s.owners_k)
                    )
                )
            ).all()
        changes: dict[str, tuple[int, float]] = {}
        for adapter_id, k, rate, updated_at in warm:
            now_rate = placement.decayed_rate(rate, as_utc(updated_at), now, s.stats_tau_s)
            new_k = placement.owner_count(
                now_rate, k, k_min=s.owners_k, capacity=s.replica_capacity_tokens_per_s, cooldown_ratio=s.cooldown_ratio
            )
            if new_k != k or (now_rate == 0.0 and rate > 0):
                changes[adapter_id] = (new_k, now_rate)
        if not stale and not changes:
            return False
        bumped = False
        async with self.db.write() as session:
            if stale:
                result = await session.execute(
                    update(Replica)
                    .where(Replica.replica_id.in_(stale), Replica.status == "up", Replica.last_seen < cutoff)
                    .values(status="down")
                )
                if result.rowcount:
                    log.warning("replicas marked down (unseen %.0f s): %s", s.replica_timeout_s, ", ".join(stale))
                    bumped = True
            for adapter_id, (new_k, now_rate) in changes.items():
                row = await session.get(Adapter, adapter_id)
                if row is None:
                    continue
                if row.owners_k != new_k:
                    bumped = True
                    row.owners_k = new_k
                if now_rate == 0.0:
                    row.load_tokens_per_s = 0.0
                    row.load_updated_at = now
            if bumped:
                await self.db.bump(session)
        return bumped

    # -- read-your-writes for deploys ---------------------------------------------------------

    def router_polled(self, router_id: str, applied_version: int) -> None:
        """A router asked for the routing table holding `applied_version` (its If-None-Match)."""
        if len(self.routers) > 1000:  # forget the long gone
            cutoff = time.monotonic() - ROUTER_TTL_S
            self.routers = {k: v for k, v in self.routers.items() if v[1] >= cutoff}
        self.routers[router_id[:64]] = (applied_version, time.monotonic())

    async def wait_for_routers(self, version: int | None = None) -> bool:
        """After a deploy (alias set, rollback, upload with alias): wait, at most
        `settings.deploy_wait_s`, until every router long-polling this registry has applied
        `version` (default: the current one), so a request sent when the call returns sees it.
        True when they all have."""
        if version is None:
            version = await self.db.version()
        deadline = time.monotonic() + self.settings.deploy_wait_s
        while True:
            now = time.monotonic()
            behind = [r for r, (v, at) in self.routers.items() if now - at < ROUTER_TTL_S and v < version]
            if not behind:
                return True
            if now >= deadline:
                log.warning("deploy of version %d: routers %s have not applied it within %.1f s",
                            version, ", ".join(sorted(behind)), self.settings.deploy_wait_s)
                return False
            await asyncio.sleep(0.01)

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep sweeping: a DB hiccup must not stop liveness tracking
                log.exception("registry sweep failed")
