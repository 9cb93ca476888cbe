"""Registry settings: what `lorafarm registry` flags (and their `LORAFARM_*` defaults) configure."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///var/registry.db"


@dataclass
class RegistrySettings:
    database_url: str = DEFAULT_DATABASE_URL
    store_url: str = "file://var/store"  # made absolute in __post_init__
    s3_endpoint_url: str | None = None
    admin_token: str | None = None  # None: every /internal call is refused (401)
    signing_key: str | os.PathLike | None = None  # Ed25519 private PEM; generated here when missing
    base_models: dict[str, str | os.PathLike] = field(default_factory=dict)  # name -> model folder
    trust: list[str | os.PathLike] = field(default_factory=list)  # extra public keys accepted by register
    rank_limit: int = 64
    owners_k: int = 2  # default owner count of an adapter
    replica_capacity_tokens_per_s: float = 640.0  # what one replica serves of one adapter
    stats_tau_s: float = 60.0  # time constant of an adapter's decaying tokens/s estimate
    cooldown_ratio: float = 0.8  # k is lowered only once the rate is below this share of (k-1) replicas
    stats_retention_s: float = 3600.0  # adapter_stats rows older than this are pruned
    replica_timeout_s: float = 30.0  # a replica unseen this long is marked down
    deploy_wait_s: float = 2.0  # an alias change returns once long-polling routers applied it (at most this)
    sweep_interval_s: float = 2.0  # how often replica liveness and owner counts are re-evaluated
    max_upload_bytes: int = 2 * 1024**3
    rollout_tick_s: float = 1.0  # how often running rollouts are evaluated (registry/rollout.py)
    version_stats_retention_s: float = 2 * 86400.0  # version_stats rows older than this are pruned
    state_dir: str | os.PathLike = "var"

    def __post_init__(self) -> None:
        if self.store_url.startswith("file://") and not self.store_url.startswith("file:///"):
            rel = self.store_url[len("file://") :]
            self.store_url = Path(rel).resolve().as_uri()
        if self.signing_key is None:
            self.signing_key = Path(self.state_dir) / "registry-signing-key" / "private.pem"

    @classmethod
    def from_env(cls, **overrides) -> RegistrySettings:
        """Defaults from LORAFARM_* variables, then `overrides` (None values are ignored)."""
        env = os.environ.get
        state = overrides.get("state_dir") or env("LORAFARM_STATE_DIR") or "var"
        values: dict = {
            "state_dir": state,
            "database_url": env("LORAFARM_DATABASE_URL") or f"sqlite+aiosqlite:///{Path(state) / 'registry.db'}",
            "store_url": env("LORAFARM_STORE_URL") or (Path(state).resolve() / "store").as_uri(),
            "s3_endpoint_url": env("LORAFARM_S3_ENDPOINT_URL") or None,
            "admin_token": env("LORAFARM_ADMIN_TOKEN") or None,
            "signing_key": env("LORAFARM_SIGNING_KEY") or None,
            "trust": [p for p in (env("LORAFARM_TRUST") or "").split(":") if p],
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
