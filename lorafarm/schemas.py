"""Wire schemas shared by several services (pydantic models)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ReplicaState(BaseModel):
    """GET /internal/replicas/{replica_id}/state: what a replica holds, polled by the router."""

    replica_id: str
    base_model_hash: str
    models: list[str] = Field(description="base (and embedding) model names this replica serves")
    task: str = Field(default="generate", description="generate (chat/completions) | embed (embeddings)")
    gpu_adapters: list[str] = Field(default_factory=list, description="adapter ids mounted in device slots")
    ram_adapters: list[str] = Field(default_factory=list, description="adapter ids held in host RAM")
    queue_depth: int = 0
    running: int = 0
    tokens_in_flight: int = 0
    evictions_per_min: float = 0.0
    loads_per_min: float = 0.0
    kv_cache_usage: float = 0.0
