"""Router settings: one dataclass, filled from CLI flags whose defaults come from `LORAFARM_*`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from lorafarm.openai_schemas import DEFAULT_MAX_TOKENS
from router.routing import SCORES, STRATEGIES


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw not in (None, "") else default


@dataclass
class RouterSettings:
    """Everything `create_app()` needs. Defaults are the production values; tests shorten the
    intervals. Times are seconds."""

    registry_url: str = field(
        default_factory=lambda: os.environ.get("LORAFARM_REGISTRY_URL", "http://127.0.0.1:8100")
    )
    # bearer token for the registry's /internal/* endpoints and for every replica call
    admin_token: str | None = field(default_factory=lambda: os.environ.get("LORAFARM_ADMIN_TOKEN") or None)

    # routing
    strategy: str = "least_tokens"
    affinity: bool = True  # False: the strategy alone over every healthy replica (the A/B baseline)
    score: str = "expected-ttft"  # order of warm/owner replicas; class-order: the pre-issue-13 rule (SCORES)
    # a replica is over its load threshold at load_threshold_tokens x capacity_weight tokens in
    # flight, or at load_threshold_queue requests waiting; then its warm/owner class is skipped
    load_threshold_tokens: int = 8192
    load_threshold_queue: int = 16
    default_owners_k: int = 2  # when the routing table does not carry owners_k for an adapter

    # replica view
    poll_interval: float = 1.0  # GET /internal/replicas/{id}/state cadence
    state_timeout: float = 1.5  # a state poll that times out counts as a failed health check
    health_timeout: float = 1.5
    health_failures: int = 3  # consecutive failed health checks before a replica is taken out
    routing_poll_interval: float = 1.0  # GET /internal/routing (with ETag) cadence when not long-polling
    routing_long_poll: float = 20.0  # the registry holds a poll this long until the table changes (0: off)
    miss_negative_ttl: float = 1.0  # an unknown model name, refreshed for and still unknown, is not refetched
    registry_timeout: float = 5.0

    # proxy
    connect_timeout: float = 2.0
    first_byte_timeout: float = 10.0  # a stream's first byte (after admission): else fail over
    # the longest silence between two chunks of a stream (replicas send `: keep-alive` comments while a
    # request waits), else an error event ends it
    read_timeout: float = 10.0
    # the default deadline of a non-streamed request (its replica is left sooner once it leaves routing)
    non_stream_timeout: float = 600.0
    max_request_timeout: float = 3600.0  # the most a client may ask for with `x-request-timeout`
    # poison requests (router/poison.py): a request in flight on a replica that died goes to at most
    # death_retries more replicas; a body in flight at poison_threshold deaths is refused poison_cooloff s
    death_retries: int = 1
    poison_threshold: int = 2
    poison_cooloff: float = 600.0
    max_attempts: int = 3  # replicas tried before the first byte
    max_connections: int = 1024

    # auth cache
    auth_ttl: float = 30.0
    auth_negative_ttl: float = 5.0
    # registry outage: keys this router verified keep serving while it heard from the registry within
    # this many seconds (new keys: 503 auth_unavailable at once; router/auth.py, docs/operations.md)
    auth_stale_grace: float = 300.0

    # rate limits (per tenant; the registry's values win, these apply where it has none)
    default_requests_per_s: float | None = None  # None = unlimited
    default_tokens_per_s: float | None = None
    burst_seconds: float = 1.0  # bucket capacity = rate x burst_seconds (at least one request)
    # shared rate-limit buckets for several routers (redis://host:6379/0); None: per router
    redis_url: str | None = field(default_factory=lambda: os.environ.get("LORAFARM_REDIS_URL") or None)
    # the token cost of a request that sets no max_tokens: what the replica generates for it
    # (lorafarm.openai_schemas.DEFAULT_MAX_TOKENS, the one default of both)
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    # SLO
    slo_ttft_target: float = field(default_factory=lambda: _env_float("LORAFARM_SLO_TTFT_TARGET", 1.0))
    slo_window: float = 300.0
    slo_min_samples: int = 10
    slo_eval_interval: float = 1.0

    # stats pushed to the registry
    stats_window: float = 10.0

    # cost: the price of one replica-hour (any currency); dashboards derive cost per 1M tokens from it
    price_per_replica_hour: float = field(default_factory=lambda: _env_float("LORAFARM_PRICE_PER_REPLICA_HOUR", 0.0))

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, not {self.score!r}")
        if self.poll_interval <= 0 or self.routing_poll_interval <= 0:
            raise ValueError("poll intervals must be positive")
        if self.health_failures < 1:
            raise ValueError("health_failures must be at least 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.death_retries < 0:
            raise ValueError("death_retries must be 0 or more")
        if self.poison_threshold < 1:
            raise ValueError("poison_threshold must be at least 1")
        if self.read_timeout <= 0 or self.non_stream_timeout <= 0 or self.max_request_timeout <= 0:
            raise ValueError("timeouts must be positive")
        self.registry_url = self.registry_url.rstrip("/")
