"""Request and answer bodies of the registry HTTP API (docs/contracts.md, "Registry HTTP API").
The tables live in `registry.tables`; these are the wire shapes, and Litestar derives the OpenAPI
document from them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from litestar.datastructures import UploadFile
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from lorafarm.limits import WORKER_KEY_ENV_PATTERN

TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{1,62}$"
ADAPTER_ID_PATTERN = r"^ad-[0-9a-f]{20}$"
SHA256_PATTERN = r"^sha256:[0-9a-f]{64}$"
REPLICA_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ALIAS_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}:[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
ALIAS_PATTERN = r"^[a-z0-9][a-z0-9-]{1,62}/[A-Za-z0-9][A-Za-z0-9._-]{0,127}:[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI-style error object, the body of every 4xx/5xx answer."""

    error: ErrorDetail


# -- tenants and keys --------------------------------------------------------------------------


class TenantCreate(_In):
    name: str = Field(pattern=TENANT_ID_PATTERN, description="the tenant id (a slug)")
    requests_per_s: float | None = Field(default=None, ge=0, description="rate limit; null: unlimited")
    tokens_per_s: float | None = Field(default=None, ge=0, description="rate limit; null: unlimited")
    weight: float | None = Field(default=None, gt=0, le=1024, description="fair-scheduling weight: the tenant's "
                                 "share of a replica's batch relative to other tenants'; null: 1 (equal shares)")


class TenantLimits(_In):
    """PATCH body: the fields sent are changed (null: unlimited, or weight 1); the fields left out are kept."""

    requests_per_s: float | None = Field(default=None, ge=0, description="rate limit; null: unlimited")
    tokens_per_s: float | None = Field(default=None, ge=0, description="rate limit; null: unlimited")
    weight: float | None = Field(default=None, gt=0, le=1024, description="fair-scheduling weight: the tenant's "
                                 "share of a replica's batch relative to other tenants'; null: 1 (equal shares)")


class TenantCreated(BaseModel):
    tenant_id: str
    api_key: str = Field(description="shown only in this answer")
    key_id: str


class TenantOut(BaseModel):
    tenant_id: str
    requests_per_s: float | None
    tokens_per_s: float | None
    weight: float | None = None  # fair-scheduling weight; null: 1
    created_at: datetime


class KeyCreated(BaseModel):
    key_id: str
    api_key: str = Field(description="shown only in this answer")


class KeyRotated(KeyCreated):
    revoked_key_ids: list[str] = Field(description="the keys this rotation revoked")


class KeyOut(BaseModel):
    key_id: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class VerifyRequest(_In):
    api_key: str = Field(max_length=512)


class VerifyResult(BaseModel):
    tenant_id: str
    key_id: str
    requests_per_s: float | None
    tokens_per_s: float | None
    weight: float | None = None  # fair-scheduling weight (routers send it to replicas); null: 1


# -- adapters ----------------------------------------------------------------------------------


class AdapterRegister(_In):
    """Metadata of a signed archive already in the registry's object store."""

    adapter_id: str = Field(pattern=ADAPTER_ID_PATTERN)
    tenant_id: str = Field(pattern=TENANT_ID_PATTERN)
    version: int = Field(ge=1, le=2**31 - 1)
    base_model_hash: str = Field(pattern=SHA256_PATTERN)
    rank: int = Field(ge=1, le=65536)
    alpha: float = Field(gt=0, le=1e9)
    target_modules: list[str] = Field(min_length=1, max_length=64)
    weights_uri: str = Field(min_length=1, max_length=1024)
    checksum: str = Field(pattern=SHA256_PATTERN)


class AdapterOut(BaseModel):
    adapter_id: str
    tenant_id: str
    version: int
    base_model_hash: str
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    weights_uri: str
    checksum: str = Field(description="sha256 of the signed .lar archive")
    status: str
    created_at: datetime
    tags: dict[str, Any] = Field(default_factory=dict, description="what the training job said about this "
                                 "version (run name, step, eval metrics...)")


class AdapterUploaded(AdapterOut):
    alias: str | None = None
    created: bool = Field(description="false when the same content was already registered")


@dataclass
class AdapterUploadForm:
    """multipart/form-data of POST /internal/adapters/upload: either `files` (adapter_config.json
    and adapter_model.safetensors, by file name) or one `archive` (a tar of those files)."""

    tenant_id: str
    alias: str | None = None
    base_model: str | None = None
    base_model_hash: str | None = None  # the base the adapter was trained on (`lorafarm archive basehash DIR`)
    assume_base: str | None = None  # "true": no hash sent, the caller vouches it matches the chosen base
    version: str | None = None
    tags: str | None = None  # a JSON object of scalars: run name, step, eval metrics... (kept with the version)
    files: list[UploadFile] | None = None
    archive: UploadFile | None = None


# -- aliases -----------------------------------------------------------------------------------


class AliasSet(_In):
    adapter_id: str = Field(pattern=ADAPTER_ID_PATTERN)


class SplitTargetIn(_In):
    adapter_id: str = Field(pattern=ADAPTER_ID_PATTERN)
    weight: float = Field(gt=0, le=100, description="percent of the alias's traffic")


class AliasSplit(_In):
    """A weighted split of an alias's traffic: weights are percents summing to 100."""

    targets: list[SplitTargetIn] = Field(min_length=2, max_length=8)


class AliasPromote(_In):
    adapter_id: str | None = Field(default=None, pattern=ADAPTER_ID_PATTERN,
                                   description="the version that gets all traffic (default: the split's "
                                               "version other than the stable one)")


class SplitTarget(BaseModel):
    adapter_id: str
    weight: float


class AliasOut(BaseModel):
    alias: str
    tenant_id: str
    adapter_id: str = Field(description="the stable version: all traffic without a split; a rollback keeps it")
    previous_adapter_id: str | None
    updated_at: datetime
    split: list[SplitTarget] | None = Field(default=None, description="weighted split of the traffic; null: all "
                                            "to adapter_id")
    rollout_id: int | None = Field(default=None, description="the rollout running on this alias")


# -- rollouts and per-version stats ----------------------------------------------------------------


class RolloutBoundsIn(_In):
    """registry/rollout_policy.py `Bounds`; a field left out keeps its default."""

    max_error_rate_increase: float | None = Field(default=None, ge=0, le=1)
    max_ttft_p95_ratio: float | None = Field(default=None, ge=1, le=100)
    ttft_slack_s: float | None = Field(default=None, ge=0, le=600)
    min_requests: int | None = Field(default=None, ge=1, le=10**7)
    min_ttft_samples: int | None = Field(default=None, ge=1, le=10**7)


class RolloutCreate(_In):
    alias: str = Field(pattern=ALIAS_PATTERN)
    adapter_id: str = Field(pattern=ADAPTER_ID_PATTERN, description="the new version")
    steps: list[int] = Field(default_factory=lambda: [10, 50, 100], min_length=2, max_length=20,
                             description="percent of the traffic on the new version per step; increasing, the "
                                         "last is 100 (the promotion)")
    interval_s: float = Field(default=300.0, ge=0.1, le=86400, description="how long each step runs at least")
    bounds: RolloutBoundsIn | None = None


class RolloutOut(BaseModel):
    rollout_id: int
    alias: str
    tenant_id: str
    old_adapter_id: str
    new_adapter_id: str
    steps: list[int]
    interval_s: float
    bounds: dict[str, Any]
    step_index: int
    percent: int = Field(description="the new version's share of the traffic now")
    step_started_at: datetime
    state: str = Field(description="running | promoted | rolled_back | aborted")
    reason: str | None
    breached: str | None = Field(description="the bound a rollback breached: error_rate | ttft_p95")
    last_evaluation: dict[str, Any]
    actor: str
    created_at: datetime
    finished_at: datetime | None


_COUNT = Field(default=0, ge=0, le=2**50)


class VersionWindowIn(_In):
    """One version's counts over a router's window (lorafarm.client.summary.VersionCounts)."""

    alias: str = Field(min_length=1, max_length=255)
    adapter_id: str = Field(min_length=1, max_length=32)
    requests: int = _COUNT
    errors: int = _COUNT
    client_errors: int = _COUNT
    cancels: int = _COUNT
    prompt_tokens: int = _COUNT
    completion_tokens: int = _COUNT
    error_kinds: dict[str, int] = Field(default_factory=dict, max_length=64)
    finish_reasons: dict[str, int] = Field(default_factory=dict, max_length=64)
    ttft: dict[str, int] = Field(default_factory=dict, max_length=128, description="bucket index -> count")


class VersionStatsIn(_In):
    window_s: float = Field(gt=0, le=86400)
    router_id: str | None = Field(default=None, max_length=64)
    versions: list[VersionWindowIn] = Field(default_factory=list, max_length=100_000)


class VersionSummaryOut(BaseModel):
    requests: int
    errors: int
    error_rate: float | None
    error_kinds: dict[str, int]
    client_errors: int
    cancels: int
    cancel_rate: float | None
    ttft_count: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: dict[str, int]


class AliasMetricsOut(BaseModel):
    alias: str
    since: datetime
    until: datetime
    versions: dict[str, VersionSummaryOut] = Field(description="adapter id -> its traffic over the span")


# -- replicas and placements -------------------------------------------------------------------


class ReplicaJoin(_In):
    replica_id: str = Field(pattern=REPLICA_ID_PATTERN)
    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=1024)
    base_model_hash: str = Field(pattern=SHA256_PATTERN)
    models: list[str] = Field(default_factory=list, max_length=64)
    capacity_weight: float = Field(default=1.0, gt=0, le=1e6)


class ReplicaOut(BaseModel):
    replica_id: str
    url: str
    base_model_hash: str
    models: list[str]
    capacity_weight: float
    last_seen: datetime
    status: str = Field(description="up | down")


class PlacementOut(BaseModel):
    adapter_id: str
    k: int
    owners: list[str]


class ReplicaPlacements(BaseModel):
    replica_id: str
    adapters: list[str]


# -- stats and routing -------------------------------------------------------------------------


class AdapterWindow(_In):
    adapter_id: str = Field(max_length=64)
    requests: int = Field(ge=0, le=2**40)
    tokens: int = Field(ge=0, le=2**50)
    gpu_hits: int = Field(default=0, ge=0, le=2**40)


class StatsIn(_In):
    window_s: float = Field(gt=0, le=86400)
    adapters: list[AdapterWindow] = Field(default_factory=list, max_length=1_000_000)


class RoutingAlias(BaseModel):
    adapter_id: str
    tenant_id: str
    split: list[SplitTarget] | None = None  # a weighted split (router/routing.py pick_version); left out when none

    @model_serializer(mode="wrap")
    def _without_empty_split(self, handler):
        out = handler(self)
        if out.get("split") is None:
            out.pop("split", None)  # an alias without a split reads as it always did
        return out


class RoutingAdapter(BaseModel):
    tenant_id: str
    base_model_hash: str
    owners_k: int
    status: str
    # a deploy or rollback moved an alias away from it (it is some alias's previous target) and no
    # alias points to it now: replicas free its slot and RAM instead of leaving it to LRU
    retired: bool = False


WORKER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
ENV_VAR_PATTERN = WORKER_KEY_ENV_PATTERN  # only LORAFARM_WORKER_KEY_*: never another of the router's secrets


class WorkerIn(_In):
    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=1024)
    kind: str = Field(pattern=r"^(openai|ollama)$", description="openai (any OpenAI-compatible server) | ollama")
    api_key_env: str | None = Field(default=None, max_length=128, json_schema_extra={"pattern": ENV_VAR_PATTERN},
                                    description="environment variable of the router holding the worker's API key: "
                                                "LORAFARM_WORKER_KEY_<NAME> only")
    weight: float = Field(default=1.0, gt=0, le=1e6)

    @field_validator("api_key_env")
    @classmethod
    def _key_env(cls, v):
        from lorafarm.limits import worker_key_env_error

        why = worker_key_env_error(v)
        if why:
            raise ValueError(why)
        return v


class WorkerOut(BaseModel):
    name: str
    url: str
    kind: str
    api_key_env: str | None
    weight: float
    created_at: datetime


class CriticalModelIn(_In):
    model: str = Field(min_length=1, max_length=255, description="model name as the catalog lists it")
    critical: bool = True


class CriticalModelOut(BaseModel):
    model: str
    created_at: datetime


class RoutingTable(BaseModel):
    version: int
    aliases: dict[str, RoutingAlias]
    adapters: dict[str, RoutingAdapter]
    base_models: dict[str, str]
    replicas: list[ReplicaOut]
    rank_limit: int
    workers: list[WorkerOut] = Field(default_factory=list)
    critical_models: list[str] = Field(default_factory=list)
    # keys revoked within the last hour: routers forget cached tenants verified with them
    revoked_key_ids: list[str] = []


class Health(BaseModel):
    status: str
    version: int


# -- audit -------------------------------------------------------------------------------------


class AuditOut(BaseModel):
    id: int
    at: datetime
    actor: str
    client: str | None
    action: str = Field(description="e.g. tenant.create, key.rotate, adapter.delete, alias.set")
    target_kind: str = Field(description="tenant | key | adapter | alias | worker | model")
    target: str
    detail: dict
