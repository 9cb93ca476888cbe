"""What configures a replica: `ReplicaConfig` (everything `lorafarm replica` sets, `cli`), the engine
settings it carries whole (`handler.engine.config.EngineConfig`) and the serving `Limits`.

    cfg = ReplicaConfig(base_dir=Path("models/dev"), engine=REPLICA_ENGINE.replace(max_batch=8),
                        limits=Limits(max_waiting=64))

Each setting is declared once: an engine setting is a field of `EngineConfig` (its flag too), a
limit of how requests are taken a field of `Limits`, the rest (identity, registry, store, adapter
tiers) a field of `ReplicaConfig`. Light on purpose: the CLI imports it to build the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from handler.engine.config import EngineConfig
from lorafarm import openai_schemas as oai

# The engine of a replica configured without the CLI (tests, benchmarks): float32 weights on every
# device, the prefix cache on (the CLI's defaults are EngineConfig's: bfloat16 on cuda)
REPLICA_ENGINE = EngineConfig(dtype="float32", prefix_cache=True)


@dataclass
class Limits:
    """How a replica takes requests: caps, shedding, defaults, timeouts (not the engine's settings:
    `EngineConfig`)."""

    max_body_bytes: int = 1024 * 1024  # request body cap (413 above)
    max_waiting: int = 256  # requests waiting for an adapter or a batch place (429 above)
    # admission: shed with 503 overloaded + Retry-After *before* accepting when the engine's remaining
    # work (unprefilled prompt + tokens still to generate, waiting and running) plus this request's
    # would pass this many tokens; 0: no token bound (the waiting-queue cap still applies: 429)
    max_queued_tokens: int = 65536
    shed_retry_after_s: int = 1
    # liveness (issue 26): a stream whose request still waits (adapter, queue, prefill) gets an SSE
    # comment `: keep-alive` this often, so the router's read timeout measures silence, not time to
    # first token; 0: never
    stream_keepalive_s: float = 2.0
    # chat default when the client sends no max_tokens: the one default the router charges too
    default_max_tokens: int = oai.DEFAULT_MAX_TOKENS
    rank_limit: int = 64  # the fleet's rank limit: larger adapters are refused at load
    cancel_grace_s: float = 5.0  # after a cancel, how long to wait for the engine to let go
    load_timeout_s: float = 30.0  # the load endpoint answers 202 (still loading) after this
    # untrusted grammar work (handler.grammar.pool): worker processes, per-compile limits, cache
    grammar_workers: int = 2
    grammar_timeout_s: float = 4.0  # x2 (worker compile + the replica's build) < the router's first-byte timeout
    grammar_memory_bytes: int = 1024**3
    grammar_cache_bytes: int = 256 * 1024**2  # compiled matchers in the replica; a tenant gets 1/4
    prep_inline_bytes: int = 16 * 1024  # bodies above this are tokenized off the event loop
    # fair shares of the shared queues (issue 35; handler.serving.prep, handler.grammar.pool): the prep
    # threads that parse and tokenize large bodies (a tenant on all but one of them), the prep jobs a
    # tenant may have waiting (429 prep_queue_full above) and all tenants together (a tenant under its
    # share is still admitted); the grammar compiles a tenant may have waiting (429 grammar_queue_full)
    # and all tenants together (same share rule)
    prep_threads: int = 2
    prep_tenant_queue: int = 8
    prep_max_queued: int = 64
    grammar_tenant_waiting: int = 16
    grammar_max_waiting: int = 64


@dataclass
class ReplicaConfig:
    """Everything `lorafarm replica` configures (see `handler.cli`)."""

    base_dir: Path
    replica_id: str = "r0"
    model_name: str | None = None  # default: the base folder's name
    host: str = "127.0.0.1"
    port: int = 8200
    advertise_url: str | None = None  # what the registry hands the router; default http://host:port
    registry_url: str | None = None  # None: standalone
    admin_token: str | None = None
    store_url: str | None = None
    s3_endpoint_url: str | None = None
    trust: list[Path] = field(default_factory=list)
    adapter_catalog: Path | None = None  # standalone: JSON {adapter_id: weights_uri} into the store
    slots: int = 8  # device slots per rank pool
    rank_pools: dict[int, int] | None = None  # overrides `slots`: {pool rank: slots}
    ram_bytes: int = 4 * 1024**3
    load_nice: int = 10  # CPU priority (nice) of adapter-load threads: below the decode loop's
    disk_bytes: int = 32 * 1024**3
    disk_dir: Path | None = None  # default var/replicas/<id>
    merged_adapter: str | None = None
    engine: EngineConfig = REPLICA_ENGINE  # device, dtype, KV budget, batch, attention... (whole, to the engine)
    limits: Limits = field(default_factory=Limits)
    heartbeat_s: float = 1.0
    placements_refresh_s: float = 30.0  # re-read owned adapters (placements move as replicas come and go)
    prewarm: int | None = None  # owned adapters to pre-warm into slots (default: one pool's slots)
    pull_owned: bool = True
    prefetch_interval_s: float = 0.0  # pre-warm the most requested adapters this often (0: never; CLI default 10)
    prefetch_top: int = 16  # how many of the most requested adapters to keep warm
    shutdown_grace_s: float = 10.0  # SIGTERM: streams in flight get this long to finish

    def resolved_model_name(self) -> str:
        return self.model_name or Path(self.base_dir).resolve().name

    def resolved_disk_dir(self) -> Path:
        return Path(self.disk_dir) if self.disk_dir else Path("var") / "replicas" / self.replica_id

    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"
