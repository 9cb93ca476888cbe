"""`lorafarm up` (the farm in the foreground) and `lorafarm demo` (start, one streamed chat, stop)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import threading
from pathlib import Path


def _up(args: argparse.Namespace) -> int:
    from lorafarm.errors import CliError
    from lorafarm.farm import Farm, FarmPorts, examples
    from lorafarm.realbase import parse_base

    ports = FarmPorts(router=args.port, registry=args.registry_port, replica_base=args.replica_port)
    bases = dict(parse_base(b) for b in args.base)
    if len(bases) != len(args.base):
        raise CliError("--base: two base models with the same name; name them: --base NAME=DIR")
    if args.adapters and not bases:
        raise CliError("--adapters needs --base (the default model gets the generated demo adapters)")
    if args.dev and bases:
        raise CliError("--dev and --base both choose the model: give one")
    farm = Farm(Path(args.state_dir), replicas=args.replicas, ports=ports, bases=bases, real=not (args.dev or bases),
                adapter_dirs=[Path(a) for a in args.adapters], assume_base=args.assume_base,
                replica_args=shlex.split(args.replica_flags), router_args=shlex.split(args.router_flags),
                embeddings=args.embeddings, answer_check=True)
    stopping = False

    def _terminate(signum, frame):  # SIGTERM behaves like Ctrl-C; a second signal does not cut the stop short
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    # SIGINT installed explicitly: a farm started from a script (`make serve &`, CI, a harness) inherits
    # SIGINT ignored, and Python then leaves it ignored, so the SIGINT meant to stop the farm did nothing
    # and the caller's fallback SIGKILL orphaned the registry and replicas (own sessions)
    signal.signal(signal.SIGINT, _terminate)
    try:
        info = farm.up()  # returns once the base and a demo alias have answered a chat through the router
        print(examples(info), flush=True)
        print(f"farm.json: {farm.farm_json}", flush=True)
        if farm.pending_demos:  # another recipe or base than the shipped demo adapters: trained now, beside serving
            threading.Thread(target=_train_later, args=(farm,), name="demo-adapters", daemon=True).start()
        signal.pause()
    except KeyboardInterrupt:
        print("lorafarm: stopping", file=sys.stderr)
    finally:
        farm.stop()
    return 0


def _train_later(farm) -> None:
    from lorafarm.errors import CliError

    try:
        farm.train_pending_demos()
    except CliError as e:
        print(f"lorafarm up: error: {e} (the farm goes on serving the base)", file=sys.stderr, flush=True)


def _demo(args: argparse.Namespace) -> int:
    from openai import OpenAI

    from lorafarm.farm import Farm, FarmPorts

    from lorafarm.realmodel import default_cache_dir

    with tempfile.TemporaryDirectory(prefix="lorafarm-demo-") as tmp:
        state = Path(args.state_dir) if args.state_dir else Path(tmp)
        # without --state-dir the dev model and canaries are made once in the user cache, not in the
        # temporary state dir (which retrained them every run)
        assets = None if args.state_dir else default_cache_dir() / "demo"
        farm = Farm(state, replicas=args.replicas, ports=FarmPorts.free(args.replicas), assets_dir=assets,
                    answer_check=True)
        try:
            info = farm.up()
            tenant = info["tenants"][0]
            alias = sorted(tenant["aliases"])[0]
            client = OpenAI(base_url=info["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0)
            stream = client.chat.completions.create(
                model=alias,
                messages=[{"role": "user", "content": args.prompt}],
                max_tokens=16,
                temperature=0,
                stream=True,
            )
            answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            print(f"{alias}: {answer}")
            expected = info["markers"][alias]
            if answer != expected:
                print(f"lorafarm demo: error: expected {expected!r}", file=sys.stderr)
                return 1
        finally:
            farm.stop()
    return 0


def _farm_status(args: argparse.Namespace) -> int:
    """The router's /health in a few lines: replicas, foreign workers, the two-workers rule."""
    import httpx

    from lorafarm.errors import CliError
    from lorafarm.settings import load_farm_json

    url = args.router or load_farm_json(args.farm).get("router_url")
    if not url:
        raise CliError("no router URL: pass --router or --farm farm.json")
    try:
        h = httpx.get(f"{url.rstrip('/')}/health", timeout=5.0).json()
    except (httpx.HTTPError, ValueError) as e:
        raise CliError(f"router at {url} unreachable: {e}") from None
    print(f"router {url}: {h.get('status')}")
    print(f"replicas: {h.get('replicas', 0)} ({h.get('replicas_healthy', 0)} healthy, "
          f"{h.get('replicas_possibly_warm', 0)} possibly warm)")
    for w in h.get("workers") or []:
        state = "healthy" if w.get("healthy") else "DOWN"
        if w.get("healthy") and not w.get("catalog_fresh"):
            state = "possibly warm (catalog unavailable)"
        print(f"worker {w['worker']} ({w['kind']}, weight {w['weight']:g}): {state}; models: "
              f"{', '.join(w.get('models') or []) or '-'}; loaded: {', '.join(w.get('loaded') or []) or '-'}")
    for c in h.get("critical_models") or []:
        flag = "ok" if c["workers"] >= 2 else "DEGRADED (fewer than two healthy workers)"
        print(f"critical model {c['model']}: {c['workers']} healthy workers: {flag}")
    if h.get("degraded_models"):
        print("degraded: " + ", ".join(d["model"] for d in h["degraded_models"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("up", help="run registry, router and N replicas on this machine")
    p.add_argument("--replicas", type=int, default=2, help="number of replicas (default 2)")
    p.add_argument("--state-dir", default="var", help="where models, store, database, logs live (default var)")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--registry-port", type=int, default=8100, help="registry port (default 8100)")
    p.add_argument("--replica-port", type=int, default=8200, help="first replica port (default 8200)")
    p.add_argument("--dev", action="store_true",
                   help="serve the generated toy model (lorafarm-dev-tiny, random weights, canary adapters) instead of "
                   "the real SmolLM2-135M-Instruct and its demo adapters; what the tests use")
    p.add_argument("--embeddings", action="store_true",
                   help="add an embedding worker (the dev encoder, port --replica-port + --replicas)")
    p.add_argument("--base", action="append", default=[], metavar="[NAME=]DIR",
                   help="serve this Hugging Face checkpoint (Llama, Mistral, Qwen2; safetensors) instead of the dev "
                   "model; repeatable (replicas serve the bases round robin); NAME defaults to the folder name")
    p.add_argument("--adapters", nargs="+", action="extend", default=[], metavar="DIR",
                   help="PEFT adapter folders (or folders of them) to upload for the demo tenant, each aliased "
                   "demo/<folder>:prod")
    p.add_argument("--replica-flags", default="", metavar="'FLAGS'",
                   help="extra `lorafarm replica` flags for every replica, e.g. '--kv-cache-bytes 8GiB --slots 4'")
    p.add_argument("--router-flags", default="", metavar="'FLAGS'",
                   help="extra `lorafarm router` flags, e.g. '--read-timeout 30 --death-retries 0'")
    p.add_argument("--assume-base", action="store_true",
                   help="upload adapters that do not record their base as trained on the (only) --base")
    p.set_defaults(func=_up)

    from lorafarm.demo_adapters import register as register_demo_adapters

    register_demo_adapters(sub)

    p = sub.add_parser("demo", help="start a farm, send one streamed chat through the router, stop")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--state-dir", default=None, help="reuse a state dir (default: a temporary one)")
    p.add_argument("--prompt", default="Hello! What can you do for me?")
    p.set_defaults(func=_demo)

    farm = sub.add_parser("farm", help="the running farm as the router sees it")
    inner = farm.add_subparsers(dest="action", metavar="ACTION", parser_class=type(farm))
    inner.required = True
    p = inner.add_parser("status", help="replicas, foreign workers and latency-critical models (router /health)")
    p.add_argument("--farm", default=None, help="farm.json written by `lorafarm up` (default ./var/farm.json)")
    p.add_argument("--router", default=None, help="router URL (default: farm.json's router_url)")
    p.set_defaults(func=_farm_status)
