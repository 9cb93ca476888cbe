"""The shapes the registry answers with, as `TypedDict`s: at run time they are plain dicts (what the
JSON decodes to), and a type checker knows their keys. Timestamps are ISO 8601 strings (UTC)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TenantCreated(TypedDict):
    tenant_id: str
    api_key: str  # shown only in this answer
    key_id: str


class Tenant(TypedDict):
    tenant_id: str
    requests_per_s: float | None
    tokens_per_s: float | None
    weight: NotRequired[float | None]
    created_at: str


class KeyCreated(TypedDict):
    key_id: str
    api_key: str
    revoked_key_ids: NotRequired[list[str]]


class Adapter(TypedDict):
    """One immutable adapter version."""

    adapter_id: str
    tenant_id: str
    version: int
    base_model_hash: str
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    weights_uri: str
    checksum: str
    status: str  # active | disabled
    created_at: str
    tags: NotRequired[dict[str, Any]]  # run name, step, eval metrics... (upload `tags`)


class AdapterUploaded(Adapter):
    alias: NotRequired[str | None]
    created: bool  # False: the same files were already registered (same id)


class SplitTarget(TypedDict):
    adapter_id: str
    weight: float  # percent of the alias's traffic; a split's weights sum to 100


class Alias(TypedDict):
    alias: str
    tenant_id: str
    adapter_id: str  # the stable version: all traffic when there is no split; a rollback keeps it
    previous_adapter_id: str | None
    updated_at: str
    split: NotRequired[list[SplitTarget] | None]  # None: every request goes to adapter_id
    rollout_id: NotRequired[int | None]  # the rollout running on this alias, if any


class RolloutBounds(TypedDict, total=False):
    """When a rollout step is within bounds (registry/rollout_policy.py; defaults there)."""

    max_error_rate_increase: float  # new error rate <= old error rate + this
    max_ttft_p95_ratio: float  # new p95 TTFT <= old p95 TTFT x this + ttft_slack_s
    ttft_slack_s: float
    min_requests: int  # requests on the new version in a step before it may be promoted
    min_ttft_samples: int  # streamed requests on each version before the TTFT bound is judged


class Rollout(TypedDict):
    rollout_id: int
    alias: str
    tenant_id: str
    old_adapter_id: str
    new_adapter_id: str
    steps: list[int]  # percent of traffic on the new version per step; the last is 100
    interval_s: float
    bounds: RolloutBounds
    step_index: int
    percent: int  # the new version's share now
    step_started_at: str
    state: str  # running | promoted | rolled_back | aborted
    reason: str | None
    breached: str | None  # the bound a rollback breached: error_rate | ttft_p95
    last_evaluation: dict[str, Any]
    actor: str
    created_at: str
    finished_at: str | None


class VersionSummary(TypedDict):
    """A version's traffic over a span (lorafarm.client.summary.VersionCounts.summary)."""

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


class AliasMetrics(TypedDict):
    alias: str
    since: str
    until: str
    versions: dict[str, VersionSummary]  # adapter id -> its summary


class AliasVersion(TypedDict):
    """One version of an alias's tenant, with its role in the alias (`AsyncLorafarmClient.versions`)."""

    adapter: Adapter
    role: str  # stable | canary | previous | other
    weight: float  # its share of the alias's traffic now (percent)


class AuditEntry(TypedDict):
    id: int
    at: str
    actor: str
    client: str | None
    action: str
    target_kind: str
    target: str
    detail: dict[str, Any]
