"""SQLModel tables of the registry: the seed's adapters, aliases, placements and adapter_stats, plus
tenants, api_keys, replicas, workers (foreign servers), critical_models, the one-row registry_state (the routing table version),
audit_log, and for progressive deploys (issue 38) rollouts and version_stats.

The schema itself is created and evolved by the Alembic migrations in `registry/migrations/`
(run at start-up); these classes must stay in step with them.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import JSON, BigInteger, Column, DateTime, Float, Integer, String
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every datetime we store is UTC."""
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _ts(nullable: bool = False) -> Column:
    return Column(DateTime(timezone=True), nullable=nullable)


class Tenant(SQLModel, table=True):
    __tablename__ = "tenants"

    tenant_id: str = Field(sa_column=Column(String(63), primary_key=True))
    requests_per_s: float | None = Field(default=None, sa_column=Column(Float, nullable=True))
    tokens_per_s: float | None = Field(default=None, sa_column=Column(Float, nullable=True))
    weight: float | None = Field(default=None, sa_column=Column(Float, nullable=True))  # fair share; null: 1
    created_at: datetime = Field(default_factory=utcnow, sa_column=_ts())


class ApiKey(SQLModel, table=True):
    """A tenant's API key: only its sha256 is stored; `prefix` is for display."""

    __tablename__ = "api_keys"

    key_id: str = Field(sa_column=Column(String(32), primary_key=True))
    tenant_id: str = Field(sa_column=Column(String(63), nullable=False, index=True))
    key_hash: str = Field(sa_column=Column(String(64), nullable=False, unique=True))
    prefix: str = Field(sa_column=Column(String(16), nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_column=_ts())
    revoked_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class Adapter(SQLModel, table=True):
    """One immutable adapter version. `owners_k` is the owner count derived from traffic
    (`load_tokens_per_s`, an exponentially decaying rate updated by stats intake)."""

    __tablename__ = "adapters"

    adapter_id: str = Field(sa_column=Column(String(32), primary_key=True))
    tenant_id: str = Field(sa_column=Column(String(63), nullable=False, index=True))
    version: int = Field(sa_column=Column(Integer, nullable=False))
    base_model_hash: str = Field(sa_column=Column(String(80), nullable=False, index=True))
    rank: int = Field(sa_column=Column(Integer, nullable=False))
    alpha: float = Field(sa_column=Column(Float, nullable=False))
    target_modules: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    size_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    weights_uri: str = Field(sa_column=Column(String(1024), nullable=False))
    checksum: str = Field(sa_column=Column(String(80), nullable=False))
    content_checksum: str | None = Field(default=None, sa_column=Column(String(80), nullable=True))
    status: str = Field(default="active", sa_column=Column(String(16), nullable=False))
    # what the training job said about this version (run name, step, eval metrics...): a flat object
    tags: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    owners_k: int = Field(default=2, sa_column=Column(Integer, nullable=False))
    load_tokens_per_s: float = Field(default=0.0, sa_column=Column(Float, nullable=False))
    load_updated_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_at: datetime = Field(default_factory=utcnow, sa_column=_ts())


class Alias(SQLModel, table=True):
    """`adapter_id` is the stable version: all the traffic when `split` is null; with a split
    (`[{adapter_id, weight}]`, weights in percent summing to 100, adapter_id among them) the
    router assigns each request (sticky per end user) by weight, and a rollback returns all
    traffic to `adapter_id`."""

    __tablename__ = "aliases"

    alias: str = Field(sa_column=Column(String(255), primary_key=True))
    tenant_id: str = Field(sa_column=Column(String(63), nullable=False, index=True))
    adapter_id: str = Field(sa_column=Column(String(32), nullable=False))
    previous_adapter_id: str | None = Field(default=None, sa_column=Column(String(32), nullable=True))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=_ts())
    split: list | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class Placement(SQLModel, table=True):
    """Where an adapter actually sits, from replica heartbeats: role owner | spill, tier gpu | ram | disk.
    Owners themselves are computed by rendezvous hashing, never stored by hand."""

    __tablename__ = "placements"

    adapter_id: str = Field(sa_column=Column(String(32), primary_key=True))
    replica_id: str = Field(sa_column=Column(String(128), primary_key=True, index=True))
    role: str = Field(sa_column=Column(String(8), nullable=False))
    tier: str = Field(sa_column=Column(String(8), nullable=False))
    last_used_at: datetime = Field(default_factory=utcnow, sa_column=_ts())


class AdapterStat(SQLModel, table=True):
    """One stats window reported by a router for one adapter."""

    __tablename__ = "adapter_stats"

    id: int | None = Field(default=None, sa_column=Column(Integer, primary_key=True, autoincrement=True))
    adapter_id: str = Field(sa_column=Column(String(32), nullable=False, index=True))
    window_start: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False, index=True))
    window_s: float = Field(sa_column=Column(Float, nullable=False))
    requests: int = Field(sa_column=Column(Integer, nullable=False))
    tokens: int = Field(sa_column=Column(BigInteger, nullable=False))
    tokens_per_s: float = Field(sa_column=Column(Float, nullable=False))
    gpu_hit_rate: float | None = Field(default=None, sa_column=Column(Float, nullable=True))


class Replica(SQLModel, table=True):
    __tablename__ = "replicas"

    replica_id: str = Field(sa_column=Column(String(128), primary_key=True))
    url: str = Field(sa_column=Column(String(1024), nullable=False))
    base_model_hash: str = Field(sa_column=Column(String(80), nullable=False))
    models: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    capacity_weight: float = Field(default=1.0, sa_column=Column(Float, nullable=False))
    status: str = Field(default="up", sa_column=Column(String(8), nullable=False))
    last_seen: datetime = Field(default_factory=utcnow, sa_column=_ts())
    joined_at: datetime = Field(default_factory=utcnow, sa_column=_ts())
    state: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class Worker(SQLModel, table=True):
    """A foreign worker: a server the farm does not run (any OpenAI-compatible server, or Ollama).
    Its secret is never stored: only the name of the environment variable the router reads it from."""

    __tablename__ = "workers"

    name: str = Field(sa_column=Column(String(63), primary_key=True))
    url: str = Field(sa_column=Column(String(1024), nullable=False))
    kind: str = Field(sa_column=Column(String(16), nullable=False))  # openai | ollama
    api_key_env: str | None = Field(default=None, sa_column=Column(String(128), nullable=True))
    weight: float = Field(default=1.0, sa_column=Column(Float, nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_column=_ts())


class CriticalModel(SQLModel, table=True):
    """A latency-critical model: the router reports it degraded while fewer than two healthy workers hold it."""

    __tablename__ = "critical_models"

    model: str = Field(sa_column=Column(String(255), primary_key=True))
    created_at: datetime = Field(default_factory=utcnow, sa_column=_ts())


class RegistryState(SQLModel, table=True):
    """One row (id 1): `version` grows on every change to what the routing table shows."""

    __tablename__ = "registry_state"

    id: int = Field(default=1, sa_column=Column(Integer, primary_key=True, autoincrement=False))
    version: int = Field(default=0, sa_column=Column(BigInteger, nullable=False))


class AuditEntry(SQLModel, table=True):
    """Who changed what, when: one row per change to a tenant, key, adapter or alias (append only)."""

    __tablename__ = "audit_log"

    id: int | None = Field(default=None, sa_column=Column(Integer, primary_key=True, autoincrement=True))
    at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False, index=True))
    actor: str = Field(sa_column=Column(String(255), nullable=False))
    client: str | None = Field(default=None, sa_column=Column(String(64), nullable=True))
    action: str = Field(sa_column=Column(String(32), nullable=False))
    target_kind: str = Field(sa_column=Column(String(16), nullable=False))
    target: str = Field(sa_column=Column(String(255), nullable=False, index=True))
    detail: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


class Rollout(SQLModel, table=True):
    """A progressive deploy of `new_adapter_id` on `alias` (registry/rollout.py drives it; the
    decision is registry/rollout_policy.py). `active_alias` is the alias while the rollout runs and
    null once it ended: its unique constraint is the "one running rollout per alias" rule, on
    SQLite and PostgreSQL alike (nulls never collide)."""

    __tablename__ = "rollouts"

    rollout_id: int | None = Field(default=None, sa_column=Column(Integer, primary_key=True, autoincrement=True))
    alias: str = Field(sa_column=Column(String(255), nullable=False, index=True))
    active_alias: str | None = Field(default=None, sa_column=Column(String(255), nullable=True, unique=True))
    tenant_id: str = Field(sa_column=Column(String(63), nullable=False))
    old_adapter_id: str = Field(sa_column=Column(String(32), nullable=False))
    new_adapter_id: str = Field(sa_column=Column(String(32), nullable=False))
    steps: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # percent per step
    interval_s: float = Field(sa_column=Column(Float, nullable=False))
    bounds: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    step_index: int = Field(default=0, sa_column=Column(Integer, nullable=False))
    step_started_at: datetime = Field(default_factory=utcnow, sa_column=_ts())
    state: str = Field(default="running", sa_column=Column(String(16), nullable=False))  # running|promoted|rolled_back|aborted
    reason: str | None = Field(default=None, sa_column=Column(String(1024), nullable=True))
    breached: str | None = Field(default=None, sa_column=Column(String(32), nullable=True))
    last_evaluation: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    actor: str = Field(sa_column=Column(String(255), nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_column=_ts())
    updated_at: datetime = Field(default_factory=utcnow, sa_column=_ts())
    finished_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class VersionStat(SQLModel, table=True):
    """One stats window a router counted for one version of a split alias
    (`lorafarm.client.summary.VersionCounts`, pushed to POST /internal/stats/versions)."""

    __tablename__ = "version_stats"

    id: int | None = Field(default=None, sa_column=Column(Integer, primary_key=True, autoincrement=True))
    alias: str = Field(sa_column=Column(String(255), nullable=False, index=True))
    adapter_id: str = Field(sa_column=Column(String(32), nullable=False))
    window_start: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False, index=True))
    window_end: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    router_id: str | None = Field(default=None, sa_column=Column(String(64), nullable=True))
    counts: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


ALL_TABLES = [Tenant, ApiKey, Adapter, Alias, Placement, AdapterStat, Replica, Worker, CriticalModel, RegistryState,
              AuditEntry, Rollout, VersionStat]
