"""The router's picture of the farm: the registry's routing table plus each replica's last state.

- `apply_table(table)`: the replica list, aliases, adapters and base models from
  `GET /internal/routing` (polled every second with its ETag by the app).
- `poll_states()`: every replica's `GET /internal/replicas/{id}/state`, concurrently.
  A replica whose state cannot be fetched keeps its last known state and stays routable
  ("possibly warm"); then its `/health` is checked, and only after `health_failures` failed health
  checks in a row is it taken out of routing. A successful state or health check, or a request it
  served, puts it back.
- The router's own in-flight requests per replica (`acquire`/`release`) are added to the picture,
  so a burst between two polls does not all land on the replica that looked idle a second ago.
- `snapshot()` freezes all of it into the pure `routing.ViewSnapshot` that `choose()` reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from lorafarm.schemas import ReplicaState
from router.polling import PollGroup
from router.routing import ReplicaSnapshot, ViewSnapshot

log = logging.getLogger("lorafarm.router.view")

_GONE = {"down", "removed", "draining", "left", "dead"}


@dataclass
class ReplicaEntry:
    replica_id: str
    url: str
    base_model_hash: str = ""
    models: tuple[str, ...] = ()
    capacity_weight: float = 1.0
    state: ReplicaState | None = None
    state_ok: bool = False  # the last state fetch succeeded
    state_at: float | None = None  # monotonic time of the last good state
    health_failures: int = 0  # consecutive failed health checks (or refused requests)
    local_tokens: int = 0  # this router's requests in flight to it (estimated tokens)
    local_connections: int = 0
    registry_down: bool = False  # the registry lists it as down; kept while this router reaches it

    # derived sets, rebuilt only when the state or the registry entry changes (not per request)
    _gpu: frozenset[str] = frozenset()
    _ram: frozenset[str] = frozenset()
    _disk: frozenset[str] = frozenset()
    _load_ms: dict = field(default_factory=dict)
    _models: frozenset[str] = frozenset()
    _hash: str = ""

    def derive(self) -> None:
        st = self.state
        models = set(self.models)
        if st is not None:
            models.update(st.models)
        self._models = frozenset(models)
        self._gpu = frozenset(st.gpu_adapters) if st else frozenset()
        self._ram = frozenset(st.ram_adapters) if st else frozenset()
        held = st.adapters if st else {}
        self._disk = frozenset(a for a, h in held.items() if h.tier == "disk")
        self._load_ms = {a: h.expected_load_ms for a, h in held.items() if h.tier in ("ram", "disk")}
        self._hash = (st.base_model_hash if st and st.base_model_hash else "") or self.base_model_hash

    def snapshot(self, health_failures_limit: int, adapter_ids=()) -> ReplicaSnapshot:
        """`adapter_ids`: the registry's adapters; a replica whose models name one is in merged mode."""
        st = self.state
        return ReplicaSnapshot(
            only_adapter=next((m for m in sorted(self._models) if m in adapter_ids), None),
            replica_id=self.replica_id,
            url=self.url,
            base_model_hash=self._hash,
            models=self._models,
            capacity_weight=self.capacity_weight,
            gpu_adapters=self._gpu,
            ram_adapters=self._ram,
            disk_adapters=self._disk,
            load_ms=self._load_ms,
            tier_load_ms=dict(st.load_ms) if st else {},
            tokens_in_flight=max(st.tokens_in_flight if st else 0, self.local_tokens),
            connections=max((st.running + st.queue_depth) if st else 0, self.local_connections),
            queue_depth=st.queue_depth if st else 0,
            engine_waiting=st.engine_waiting if st else None,
            healthy=self.health_failures < health_failures_limit,
            state_fresh=self.state_ok,
            started=st is not None,
        )


@dataclass
class RoutingTable:
    """The registry's routing table, indexed for the request path."""

    version: int | None = None
    aliases: dict[str, dict] = field(default_factory=dict)  # alias -> {adapter_id, tenant_id, split}
    adapters: dict[str, dict] = field(default_factory=dict)  # adapter_id -> {tenant_id, base_model_hash, owners_k, status}
    base_models: dict[str, str] = field(default_factory=dict)  # name -> base_model_hash
    replicas: list[dict] = field(default_factory=list)
    rank_limit: int | None = None
    tenant_aliases: dict[str, list[str]] = field(default_factory=dict)
    revoked_key_ids: tuple[str, ...] = ()
    # split aliases: alias -> ((adapter_id, weight percent), ...) (router/routing.py pick_version)
    splits: dict[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)

    @classmethod
    def parse(cls, table: dict) -> RoutingTable:
        aliases = {str(a): dict(v) for a, v in (table.get("aliases") or {}).items() if isinstance(v, dict)}
        by_tenant: dict[str, list[str]] = {}
        for alias, v in aliases.items():
            if v.get("tenant_id") and v.get("adapter_id"):
                by_tenant.setdefault(str(v["tenant_id"]), []).append(alias)
        for names in by_tenant.values():
            names.sort()
        splits: dict[str, tuple[tuple[str, float], ...]] = {}
        for alias, v in aliases.items():
            targets = v.get("split")
            if not isinstance(targets, list):
                continue
            parsed = []
            for t in targets:
                try:
                    if isinstance(t, dict) and t.get("adapter_id") and float(t.get("weight") or 0) > 0:
                        parsed.append((str(t["adapter_id"]), float(t["weight"])))
                except (TypeError, ValueError):
                    continue
            if len(parsed) > 1:
                splits[alias] = tuple(parsed)
        return cls(
            version=table.get("version"),
            aliases=aliases,
            adapters={str(k): dict(v) for k, v in (table.get("adapters") or {}).items() if isinstance(v, dict)},
            base_models={str(k): str(v) for k, v in (table.get("base_models") or {}).items()},
            replicas=[r for r in (table.get("replicas") or []) if isinstance(r, dict) and r.get("replica_id")],
            rank_limit=table.get("rank_limit"),
            tenant_aliases=by_tenant,
            revoked_key_ids=tuple(str(k) for k in (table.get("revoked_key_ids") or ())),
            splits=splits,
        )


class ReplicaView:
    def __init__(
        self,
        http: httpx.AsyncClient | None = None,
        *,
        admin_token: str | None = None,
        health_failures: int = 3,
        state_timeout: float = 2.0,
        health_timeout: float = 2.0,
        load_threshold_tokens: int = 8192,
        load_threshold_queue: int = 16,
        metrics=None,
    ):
        self.http = http
        self.admin_token = admin_token
        self.health_failures = health_failures
        self.state_timeout = state_timeout
        self.health_timeout = health_timeout
        self.load_threshold_tokens = load_threshold_tokens
        self.load_threshold_queue = load_threshold_queue
        self.metrics = metrics
        self.table = RoutingTable()
        self.table_loaded = False
        self.table_at: float | None = None
        self.replicas: dict[str, ReplicaEntry] = {}
        self.catalog_version = 0  # bumped whenever the set of served models may have changed
        self._polls = PollGroup()

    # -- registry table ----------------------------------------------------------------------

    def apply_table(self, raw: dict) -> None:
        table = RoutingTable.parse(raw)
        seen = set()
        for r in table.replicas:
            rid = str(r["replica_id"])
            if not r.get("url"):
                continue
            entry = self.replicas.get(rid)
            url = str(r["url"]).rstrip("/")
            status = str(r.get("status") or "up").lower()
            registry_down = status == "down"
            if status in _GONE:
                # "down" only says the registry missed its heartbeats (it may itself have been down):
                # a replica this router reaches right now stays until its own checks fail
                reachable = entry is not None and entry.url == url and entry.state_ok and not entry.health_failures
                if not (registry_down and reachable):
                    continue
                if not entry.registry_down:
                    log.warning("registry says replica %s is down, but it answers: kept in routing", rid)
            seen.add(rid)
            if entry is None or entry.url != url:
                entry = self.replicas[rid] = ReplicaEntry(replica_id=rid, url=url)
                log.info("replica %s at %s joined the view", rid, url)
            entry.registry_down = registry_down
            entry.base_model_hash = str(r.get("base_model_hash") or "")
            entry.models = tuple(str(m) for m in (r.get("models") or ()))
            try:
                entry.capacity_weight = float(r.get("capacity_weight") or 1.0)
            except (TypeError, ValueError):
                entry.capacity_weight = 1.0
            entry.derive()
        for rid in [rid for rid in self.replicas if rid not in seen]:
            self._drop(rid)
        self.table = table
        self.table_loaded = True
        self.table_at = time.monotonic()
        self.catalog_version += 1

    def _drop(self, replica_id: str) -> None:
        if self.replicas.pop(replica_id, None) is not None:
            log.info("replica %s left the view", replica_id)
            self.catalog_version += 1
            if self.metrics:
                self.metrics.forget_replica(replica_id)

    # -- replica state -----------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    async def poll_states(self, wait: float | None = None) -> None:
        """Poll every replica's state concurrently. `wait`: return after that many seconds even if
        some replica has not answered; its poll keeps running and no second one is started for it
        meanwhile, so one hung replica never delays the freshness of the others."""
        await self._polls.run(self.replicas, self._poll_one, wait)
        self.catalog_version += 1
        if self.metrics:
            for e in self.replicas.values():
                self.metrics.observe_replica(e.snapshot(self.health_failures, self.table.adapters))

    def cancel_polls(self) -> None:
        self._polls.cancel()

    async def _poll_one(self, e: ReplicaEntry) -> None:
        assert self.http is not None
        url = f"{e.url}/internal/replicas/{quote(e.replica_id, safe='')}/state"
        try:
            r = await self.http.get(url, headers=self._headers(), timeout=self.state_timeout)
            r.raise_for_status()
            state = ReplicaState.model_validate(r.json())
        except (httpx.HTTPError, ValueError, ValidationError) as err:
            if e.state_ok or e.state_at is None:
                log.info("replica %s: state unavailable (%s); possibly warm", e.replica_id, _short(err))
            e.state_ok = False
            if e.registry_down:  # the registry gave it up and we cannot reach it either
                self._drop(e.replica_id)
                return
            if isinstance(err, httpx.TimeoutException):  # not answering at all (frozen?): a failure now,
                self.mark_failure(e.replica_id, "state poll timed out")  # then the health check's
            await self._check_health(e)
            return
        e.state = state
        e.derive()
        e.state_ok = True
        e.state_at = time.monotonic()
        if e.health_failures:
            log.info("replica %s is back", e.replica_id)
        e.health_failures = 0

    async def _check_health(self, e: ReplicaEntry) -> None:
        try:
            r = await self.http.get(f"{e.url}/health", timeout=self.health_timeout)
            ok = r.status_code < 500
        except httpx.HTTPError:
            ok = False
        if ok:
            e.health_failures = 0
        else:
            self.mark_failure(e.replica_id, "health check failed")

    # -- what the proxy reports --------------------------------------------------------------

    def mark_failure(self, replica_id: str, why: str = "") -> None:
        e = self.replicas.get(replica_id)
        if e is None:
            return
        e.health_failures += 1
        if e.health_failures == self.health_failures:
            log.warning("replica %s out of routing after %d failures in a row (%s)", replica_id, e.health_failures, why)

    def mark_success(self, replica_id: str) -> None:
        e = self.replicas.get(replica_id)
        if e is not None and e.health_failures:
            e.health_failures = 0

    def is_responsive(self, replica_id: str) -> bool:
        """Still in routing (fewer than `health_failures` failures in a row); unknown ids are not."""
        e = self.replicas.get(replica_id)
        return e is not None and e.health_failures < self.health_failures

    def acquire(self, replica_id: str, tokens: int) -> None:
        e = self.replicas.get(replica_id)
        if e is not None:
            e.local_tokens += tokens
            e.local_connections += 1

    def release(self, replica_id: str, tokens: int) -> None:
        e = self.replicas.get(replica_id)
        if e is not None:
            e.local_tokens = max(0, e.local_tokens - tokens)
            e.local_connections = max(0, e.local_connections - 1)

    # -- for routing and the catalog ---------------------------------------------------------

    def snapshot(self) -> ViewSnapshot:
        return ViewSnapshot(
            replicas=tuple(e.snapshot(self.health_failures, self.table.adapters) for e in self.replicas.values()),
            load_threshold_tokens=self.load_threshold_tokens,
            load_threshold_queue=self.load_threshold_queue,
        )

    def starting(self) -> list[str]:
        """Replicas the registry lists that have not reported a state to this router yet (still starting)."""
        return sorted(rid for rid, e in self.replicas.items() if e.state is None)

    def routable(self) -> list[ReplicaEntry]:
        return [e for e in self.replicas.values() if e.health_failures < self.health_failures]


def _short(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"[:200]
