"""Wire schemas shared by several services (pydantic models)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class HeldAdapter(BaseModel):
    """An adapter a replica holds: where, and what a request for it would wait for its load."""

    tier: str = Field(description="gpu | ram | disk")
    expected_load_ms: float = Field(0.0, description="expected time to mount it from that tier (0 on the device)")


class ReplicaState(BaseModel):
    """GET /internal/replicas/{replica_id}/state: what a replica holds, polled by the router."""

    replica_id: str
    base_model_hash: str
    models: list[str] = Field(description="base (and embedding) model names this replica serves")
    task: str = Field(default="generate", description="generate (chat/completions) | embed (embeddings)")
    gpu_adapters: list[str] = Field(default_factory=list, description="adapter ids mounted in device slots")
    ram_adapters: list[str] = Field(default_factory=list, description="adapter ids held in host RAM")
    queue_depth: int = Field(default=0, description="requests waiting: for the engine's batch, or for their adapter's load")
    engine_waiting: int | None = Field(
        default=None, description="of those, the ones waiting for the engine's batch (their adapter is ready): "
                                  "what delays a request whose adapter is already on the device; None if not reported")
    running: int = 0
    tokens_in_flight: int = 0
    evictions_per_min: float = 0.0
    loads_per_min: float = 0.0
    kv_cache_usage: float = 0.0
    adapters: dict[str, HeldAdapter] = Field(
        default_factory=dict, description="every held adapter (gpu, ram, disk) with its tier and expected load time")
    load_ms: dict[str, float] = Field(
        default_factory=dict, description="moving average load time per source tier (ram, disk, remote), ms")
