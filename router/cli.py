"""`lorafarm router`: the OpenAI-compatible gateway in front of the replicas."""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _router(args: argparse.Namespace) -> int:
    import logging

    from lorafarm.errors import CliError
    from lorafarm.serving import ClientLimits, serve
    from router.app import create_app
    from router.config import RouterSettings

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from lorafarm.accesslog import quiet_polling_loggers

    quiet_polling_loggers()  # one line per upstream call is noise
    try:
        settings = RouterSettings(
            registry_url=args.registry,
            admin_token=args.admin_token,
            strategy=args.strategy,
            affinity=not args.no_affinity,
            score=args.score,
            poll_interval=args.poll_interval,
            routing_poll_interval=args.routing_poll_interval,
            health_failures=args.health_failures,
            load_threshold_tokens=args.load_threshold_tokens,
            stats_window=args.stats_window,
            slo_ttft_target=args.slo_ttft,
            first_byte_timeout=args.first_byte_timeout,
            read_timeout=args.read_timeout,
            non_stream_timeout=args.non_stream_timeout,
            max_request_timeout=args.max_request_timeout,
            death_retries=args.death_retries,
            poison_threshold=args.poison_threshold,
            poison_cooloff=args.poison_cooloff,
            auth_ttl=args.auth_ttl,
            auth_stale_grace=args.auth_stale_grace,
            state_timeout=args.state_timeout,
            health_timeout=args.state_timeout,
            **({"redis_url": args.redis_url} if args.redis_url else {}),
            price_per_replica_hour=args.price_per_replica_hour,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    if not settings.admin_token:
        raise CliError("no admin token: pass --admin-token or set LORAFARM_ADMIN_TOKEN")
    app = create_app(settings)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: make that a clean exit 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    limits = ClientLimits(request_timeout=args.request_timeout, keep_alive_timeout=args.keep_alive_timeout,
                          max_connections=args.max_client_connections)
    serve(app, args.host, args.port, limits, log_level="warning", access_log=False, timeout_graceful_shutdown=10)
    return 0


def register(sub) -> None:
    from router.config import SCORES, STRATEGIES

    p = sub.add_parser("router", help="run the OpenAI-compatible router (gateway) in front of the replicas")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument(
        "--registry",
        default=os.environ.get("LORAFARM_REGISTRY_URL") or "http://127.0.0.1:8100",
        help="registry base URL (default $LORAFARM_REGISTRY_URL or http://127.0.0.1:8100)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("LORAFARM_ADMIN_TOKEN"),
        help="bearer token for the registry and the replicas (default $LORAFARM_ADMIN_TOKEN)",
    )
    p.add_argument("--strategy", choices=STRATEGIES, default="least_tokens",
                   help="order within a readiness class (default least_tokens)")  # fmt: skip
    p.add_argument("--score", choices=SCORES, default=SCORES[0],
                   help="order of the replicas holding or owning the adapter: expected-ttft (queue wait + "
                        "expected load) or class-order (gpu > ram > disk > owner, the older rule; default expected-ttft)")
    p.add_argument("--no-affinity", action="store_true",
                   help="ignore warm/owner classes: the strategy alone (A/B baseline)")  # fmt: skip
    p.add_argument("--poll-interval", type=float, default=1.0, help="replica state poll, seconds (default 1.0)")
    p.add_argument("--routing-poll-interval", type=float, default=1.0,
                   help="registry routing-table poll, seconds (default 1.0)")  # fmt: skip
    p.add_argument("--health-failures", type=int, default=3,
                   help="failed health checks in a row before a replica leaves routing (default 3)")  # fmt: skip
    p.add_argument("--load-threshold-tokens", type=int, default=8192,
                   help="tokens in flight per unit of capacity above which a replica spills (default 8192)")  # fmt: skip
    p.add_argument("--redis-url", default=None,
                   help="shared rate-limit buckets for several routers, e.g. redis://redis:6379/0 "
                        "($LORAFARM_REDIS_URL); without it each router enforces the limits on its own")
    p.add_argument("--stats-window", type=float, default=10.0,
                   help="seconds between per-adapter stats pushes to the registry (default 10)")  # fmt: skip
    p.add_argument("--slo-ttft", type=float, default=float(os.environ.get("LORAFARM_SLO_TTFT_TARGET") or 1.0),
                   help="per-tenant p95 TTFT target in seconds (default 1.0)")  # fmt: skip
    p.add_argument("--first-byte-timeout", type=float, default=10.0,
                   help="seconds a replica may take to send a stream's first byte before failover (default 10)")  # fmt: skip
    p.add_argument("--read-timeout", type=float, default=10.0,
                   help="longest silence (seconds) between two chunks of a stream before it ends with an error "
                        "event; replicas send keep-alive comments while a request waits (default 10)")  # fmt: skip
    p.add_argument("--non-stream-timeout", type=float, default=600.0,
                   help="default deadline (seconds) of a non-streamed request, while its replica stays in "
                        "routing; a client sets its own with the x-request-timeout header (default 600)")  # fmt: skip
    p.add_argument("--max-request-timeout", type=float, default=3600.0,
                   help="the largest x-request-timeout a client may ask for, seconds (default 3600)")  # fmt: skip
    p.add_argument("--death-retries", type=int, default=1,
                   help="replicas a request is sent to after a replica died with it in flight (default 1)")  # fmt: skip
    p.add_argument("--poison-threshold", type=int, default=2,
                   help="distinct replicas that died with the same body (tenant + request) in flight, the body "
                        "never completing since, before it is refused as poison_request (default 2)")  # fmt: skip
    p.add_argument("--poison-cooloff", type=float, default=600.0,
                   help="seconds a poison body stays refused after its last replica death (default 600)")  # fmt: skip
    p.add_argument("--auth-ttl", type=float, default=30.0,
                   help="seconds an API key check is cached while the registry is reachable (default 30)")  # fmt: skip
    p.add_argument("--auth-stale-grace", type=float, default=300.0,
                   help="registry outage: keys this router verified keep serving while it heard from the "
                        "registry within this many seconds; unverified keys get 503 (default 300)")  # fmt: skip
    p.add_argument("--state-timeout", type=float, default=1.5,
                   help="seconds a replica's state and health checks may take (default 1.5)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's headers and body; then the "
                        "connection is closed (default 30)")  # fmt: skip
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle kept-alive client connection stays open (default 5)")  # fmt: skip
    p.add_argument("--max-client-connections", type=int, default=4096,
                   help="client connections + requests in progress; 503 above (default 4096)")  # fmt: skip
    p.add_argument("--price-per-replica-hour", type=float,
                   default=float(os.environ.get("LORAFARM_PRICE_PER_REPLICA_HOUR") or 0.0),
                   help="price of one replica-hour, exported for the cost-per-1M-tokens panel and rule (default 0)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_router)
