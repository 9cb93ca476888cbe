"""`lorafarm replica`: serve one base model and its adapters (handler.serving.app on uvicorn).

The engine's flags are `EngineConfig`'s own (`EngineConfig.add_arguments`): declared once, read back
whole into `ReplicaConfig.engine` (`build_config`), handed whole to the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from handler.engine.config import DEFAULT_RANK_POOLS, EngineConfig
from handler.serving.config import Limits, ReplicaConfig
from handler.serving.sizing import size_replica
from lorafarm.capacity import ModelDims, slots_for_budget
from lorafarm.errors import CliError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str) -> int:
    """`1073741824`, `4GiB`, `512MB`, `2g` -> bytes."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MB, 1048576)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_pools(text: str) -> dict[int, int]:
    """`8:4,16:4,32:2` -> {8: 4, 16: 4, 32: 2} (rank: slots)."""
    try:
        pools = {int(r): int(s) for r, s in (part.split(":") for part in text.split(",") if part.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a pool list: {text!r} (e.g. 8:4,16:4,32:2)") from None
    if not pools or any(r < 1 or s < 0 for r, s in pools.items()):
        raise argparse.ArgumentTypeError(f"bad pool list {text!r}")
    return pools


def parse_rank_mix(text: str) -> dict[int, float]:
    """`16:1` or `8:0.25,16:0.5,32:0.25` -> {rank: share of the LoRA memory budget}."""
    try:
        mix = {int(r): float(w) for r, w in (part.split(":") for part in text.split(",") if part.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rank mix: {text!r} (e.g. 16:1 or 8:0.25,16:0.5,32:0.25)") from None
    if not mix or any(r < 1 or w < 0 for r, w in mix.items()) or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError(f"bad rank mix {text!r}")
    return mix


def pools_from_budget(base_dir, budget_bytes: int, rank_mix: dict[int, float] | None, *, rank_limit: int,
                      dtype: str) -> dict[int, int]:
    """Slots per rank pool from a LoRA memory budget (lorafarm.capacity.slots_for_budget) at the base's
    shapes; without a mix the budget is split evenly over the default pools up to the rank limit."""
    mix = rank_mix or {r: 1.0 for r in DEFAULT_RANK_POOLS if r <= rank_limit} or {rank_limit: 1.0}
    if max(mix) > rank_limit:
        raise CliError(f"--rank-mix has rank {max(mix)} above --rank-limit {rank_limit}")
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    dims = ModelDims.from_hf_config(cfg, dtype_bytes=4 if dtype == "float32" else 2)
    pools = {r: s for r, s in slots_for_budget(budget_bytes, mix, dims).items() if mix[r] > 0}
    empty = [r for r, s in pools.items() if s == 0]
    if empty:
        raise CliError(f"--lora-memory-bytes {budget_bytes} leaves no slot for rank {empty[0]} at this base's shapes")
    return pools


def auto_sizing(base_dir, dtype: str, device: str, args: argparse.Namespace):
    """KV budget and rank pools from the model's config and the machine's memory (handler/serving/sizing.py)."""
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    try:
        return size_replica(cfg, dtype_bytes=4 if dtype == "float32" else 2, device=device,
                            max_batch=args.engine_max_batch, rank_limit=args.rank_limit)
    except (KeyError, TypeError, ValueError) as e:
        raise CliError(f"--base {base_dir}: cannot size the replica from config.json ({e}); pass --kv-cache-bytes "
                       "and --slots") from None


def _env(name: str, default=None):
    return os.environ.get(name) or default


def register(sub) -> None:
    p = sub.add_parser("replica", help="serve a base model and its LoRA adapters (OpenAI API + internal API)",
                       description="Start one replica: loads the base, joins the registry (when --registry "
                                   "is given) and serves /v1/chat/completions, /v1/completions and the "
                                   "internal load/unload/state API.")
    p.add_argument("--id", dest="replica_id", default=_env("LORAFARM_REPLICA_ID", "r0"), help="replica id (default r0)")
    p.add_argument("--base", required=True, help="base model folder (Hugging Face layout)")
    p.add_argument("--task", default="generate", choices=["generate", "embed"],
                   help="generate: chat/completions with LoRA adapters (default); embed: an embedding worker "
                        "for an encoder folder (sentence-transformers layout: pooling/normalisation read from it)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8200, help="listen port (default 8200)")
    p.add_argument("--model-name", default=None, help="name clients use for the base model (default: base dir name)")
    p.add_argument("--advertise-url", default=None, help="URL the registry gives the router (default http://host:port)")
    p.add_argument("--registry", default=_env("LORAFARM_REGISTRY_URL"),
                   help="registry URL ($LORAFARM_REGISTRY_URL); without it the replica runs standalone")
    p.add_argument("--admin-token", default=_env("LORAFARM_ADMIN_TOKEN"),
                   help="bearer token for everything but /health and /metrics ($LORAFARM_ADMIN_TOKEN)")
    p.add_argument("--store-url", default=_env("LORAFARM_STORE_URL"),
                   help="object store (file:///dir or s3://bucket/prefix; $LORAFARM_STORE_URL); adapter "
                        "weights_uri must lie inside it. Without it archives come from the registry")
    p.add_argument("--s3-endpoint-url", default=_env("LORAFARM_S3_ENDPOINT_URL"), help="S3-compatible endpoint")
    p.add_argument("--trust", action="append", default=None, metavar="PUBLIC_PEM",
                   help="trusted archive signing key (repeatable; default $LORAFARM_TRUST, ':'-separated)")
    p.add_argument("--adapter-catalog", default=None,
                   help="standalone only: JSON {adapter_id: weights_uri} of archives in --store-url")
    p.add_argument("--slots", type=int, default=None,
                   help="device slots per rank pool (default: sized from the model and the machine, handler/serving/sizing.py)")
    p.add_argument("--rank-pools", type=parse_pools, default=None, metavar="R:S,...",
                   help="explicit rank pools, e.g. 8:16,16:8,32:4 (overrides --slots)")
    p.add_argument("--lora-memory-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="device memory for adapter slots, e.g. 20GB: slots per rank pool are derived from it, "
                        "--rank-mix and the base's shapes (overrides --slots)")
    p.add_argument("--rank-mix", type=parse_rank_mix, default=None, metavar="R:W,...",
                   help="share of --lora-memory-bytes per rank pool, e.g. 16:1 or 8:1,16:2,32:1 "
                        "(default: even over the pools up to --rank-limit)")
    p.add_argument("--ram-bytes", type=parse_size, default=4 * 1024**3, help="host RAM tier budget (default 4GiB)")
    p.add_argument("--disk-bytes", type=parse_size, default=32 * 1024**3, help="disk tier budget (default 32GiB; at start, at most half of what it holds plus the free space)")
    p.add_argument("--disk-dir", default=None, help="disk tier folder (default var/replicas/<id>)")
    p.add_argument("--rank-limit", type=int, default=64, help="largest adapter rank accepted (default 64)")
    p.add_argument("--merged-adapter", default=None, metavar="ADAPTER_ID",
                   help="merged mode: fold this adapter into the base and serve only it")
    # the engine's settings: every flag of EngineConfig (--device, --dtype, --kv-cache-bytes, --max-batch,
    # --max-prefill-tokens, --attention, --compile, --batch-invariant, --no-prefix-cache, --speculate)
    EngineConfig.add_arguments(p, parse_size=parse_size)
    p.add_argument("--max-waiting", type=int, default=256, help="waiting-queue cap; 429 above (default 256)")
    p.add_argument("--max-queued-tokens", type=int, default=65536,
                   help="shed with 503 overloaded + Retry-After before accepting a request when the engine's "
                        "remaining work plus the request's passes this many tokens (0: off; default 65536)")
    p.add_argument("--stream-keepalive-s", type=float, default=2.0,
                   help="seconds between SSE `: keep-alive` comments while a streamed request waits (adapter, "
                        "queue, prefill), so the router's read timeout measures silence (0: off; default 2)")
    p.add_argument("--max-body-bytes", type=parse_size, default=1024 * 1024, help="request body cap (default 1MiB)")
    p.add_argument("--grammar-workers", type=int, default=2,
                   help="worker processes that compile response_format/tools grammars (default 2)")
    p.add_argument("--grammar-timeout-s", type=float, default=4.0,
                   help="wall-time limit of one grammar compile; 400 invalid_schema above (default 4; keep twice it "
                        "below the router's --first-byte-timeout)")
    p.add_argument("--grammar-memory-bytes", type=parse_size, default=1024**3,
                   help="memory limit of one grammar compile (RLIMIT_DATA headroom of a worker; default 1GiB)")
    p.add_argument("--grammar-cache-bytes", type=parse_size, default=256 * 1024**2,
                   help="compiled grammars kept in the replica, bounded by bytes; a tenant gets 1/4 (default 256MiB)")
    p.add_argument("--prep-threads", type=int, default=2,
                   help="threads that parse and tokenize large bodies, shared fairly by tenant (a tenant uses at "
                        "most all but one; default 2)")
    p.add_argument("--prep-tenant-queue", type=int, default=8,
                   help="large bodies one tenant may have waiting for a prep thread; 429 prep_queue_full above "
                        "(default 8)")
    p.add_argument("--grammar-tenant-waiting", type=int, default=16,
                   help="grammar compiles one tenant may have waiting for a worker; 429 grammar_queue_full above "
                        "(default 16; all tenants together: 64, a tenant under its share still admitted)")
    p.add_argument("--load-nice", type=int, default=10, choices=range(0, 20), metavar="0-19",
                   help="CPU priority (nice) of adapter-load threads, so cold loads never slow the running "
                        "batch's decode (0: same priority)")
    p.add_argument("--prefetch-interval-s", type=float, default=10.0,
                   help="pre-warm this replica's most requested adapters into RAM and free slots this often (0: off)")
    p.add_argument("--prewarm", type=int, default=None, help="owned adapters pre-warmed into slots (default --slots)")
    p.add_argument("--shutdown-grace-s", type=float, default=10.0,
                   help="on SIGTERM, seconds streams in flight get to finish (default 10; deploy/ sets it "
                        "above the longest stream)")
    p.add_argument("--cache-dir", default=None,
                   help="compile caches (C kernels, inductor), shared by a farm's replicas and reused across "
                        "restarts (default $LORAFARM_CACHE_DIR, else ~/.cache/lorafarm)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_replica)


def build_config(args: argparse.Namespace) -> ReplicaConfig:
    """argparse namespace -> ReplicaConfig (checked: paths exist, flags consistent)."""
    base = Path(args.base)
    if not (base / "config.json").is_file():
        raise CliError(f"--base {base}: no config.json (a Hugging Face model folder is expected)")
    trust = args.trust
    if trust is None:
        trust = [t for t in (_env("LORAFARM_TRUST") or "").split(":") if t]
    for t in trust:
        if not Path(t).is_file():
            raise CliError(f"--trust {t}: no such file")
    if args.adapter_catalog and args.registry:
        raise CliError("--adapter-catalog is for standalone mode; with --registry the registry is the catalog")
    if args.adapter_catalog and not args.store_url:
        raise CliError("--adapter-catalog needs --store-url (its URIs point into the store)")
    if (args.registry or args.adapter_catalog or args.merged_adapter) and not trust:
        raise CliError("no trusted public key: pass --trust public.pem (or set LORAFARM_TRUST)")
    if (args.slots is not None and args.slots < 0) or args.rank_limit < 1:
        raise CliError("--slots must be >= 0 and --rank-limit >= 1")
    if args.engine_speculate < 0:
        raise CliError("--speculate must be >= 0 (0: no draft tokens)")
    if args.engine_max_prefill_tokens < 1:
        raise CliError(f"--max-prefill-tokens {args.engine_max_prefill_tokens}: must be >= 1")
    if args.prep_threads < 1 or args.prep_tenant_queue < 1 or args.grammar_tenant_waiting < 1:
        raise CliError("--prep-threads, --prep-tenant-queue and --grammar-tenant-waiting must be >= 1")
    if args.grammar_workers < 1 or args.grammar_timeout_s <= 0 or args.grammar_memory_bytes < 64 * 1024**2:
        raise CliError("--grammar-workers must be >= 1, --grammar-timeout-s > 0, --grammar-memory-bytes >= 64MiB")
    device = args.engine_device or _default_device()
    dtype = args.engine_dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    rank_pools = args.rank_pools
    if args.lora_memory_bytes is not None:
        if rank_pools:
            raise CliError("--lora-memory-bytes and --rank-pools both size the slots: give one")
        rank_pools = pools_from_budget(base, args.lora_memory_bytes, args.rank_mix, rank_limit=args.rank_limit,
                                       dtype=dtype)
    elif args.rank_mix:
        raise CliError("--rank-mix needs --lora-memory-bytes")
    slots, kv_cache_bytes = args.slots, args.engine_kv_cache_bytes
    if (rank_pools is None and slots is None) or kv_cache_bytes is None:
        sizing = auto_sizing(base, dtype, device, args)
        print(f"lorafarm replica: sized from the model and the machine: {sizing.describe()}", file=sys.stderr)
        if kv_cache_bytes is None:
            kv_cache_bytes = sizing.kv_cache_bytes
        if rank_pools is None and slots is None:
            rank_pools = {r: s for r, s in sizing.rank_pools.items() if r <= args.rank_limit}
    if slots is None:
        slots = max(rank_pools.values()) if rank_pools else 8
    try:
        engine = EngineConfig.from_args(args, dtype=dtype, kv_cache_bytes=kv_cache_bytes)
    except ValueError as e:  # flags the engine refuses together (e.g. --batch-invariant with --compile)
        raise CliError(str(e)) from None
    limits = Limits(max_body_bytes=args.max_body_bytes, max_waiting=args.max_waiting,
                    max_queued_tokens=args.max_queued_tokens, stream_keepalive_s=args.stream_keepalive_s,
                    rank_limit=args.rank_limit, grammar_workers=args.grammar_workers,
                    grammar_timeout_s=args.grammar_timeout_s, grammar_memory_bytes=args.grammar_memory_bytes,
                    grammar_cache_bytes=args.grammar_cache_bytes, prep_threads=args.prep_threads,
                    prep_tenant_queue=args.prep_tenant_queue, grammar_tenant_waiting=args.grammar_tenant_waiting)
    return ReplicaConfig(
        base_dir=base, replica_id=args.replica_id, model_name=args.model_name, host=args.host, port=args.port,
        advertise_url=args.advertise_url, registry_url=args.registry, admin_token=args.admin_token,
        store_url=args.store_url, s3_endpoint_url=args.s3_endpoint_url, trust=[Path(t) for t in trust],
        adapter_catalog=Path(args.adapter_catalog) if args.adapter_catalog else None, slots=slots,
        rank_pools=rank_pools, ram_bytes=args.ram_bytes, disk_bytes=args.disk_bytes,
        disk_dir=Path(args.disk_dir) if args.disk_dir else None, merged_adapter=args.merged_adapter,
        engine=engine, limits=limits, shutdown_grace_s=args.shutdown_grace_s,
        prefetch_interval_s=args.prefetch_interval_s, load_nice=args.load_nice,
        prewarm=args.prewarm if args.prewarm is not None or args.lora_memory_bytes is None else sum(rank_pools.values()))


def _default_device() -> str:
    import torch  # lazy: only to pick a device when --device is not given

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_embed_config(args: argparse.Namespace):
    from handler.embed.app import EmbedConfig  # lazy: the embedding worker's app (litestar, torch)

    base = Path(args.base)
    if not (base / "config.json").is_file():
        raise CliError(f"--base {base}: no config.json (a Hugging Face encoder folder is expected)")
    if args.engine_max_batch < 1:
        raise CliError("--max-batch must be >= 1")
    return EmbedConfig(base_dir=base, replica_id=args.replica_id, model_name=args.model_name, host=args.host,
                       port=args.port, advertise_url=args.advertise_url, registry_url=args.registry,
                       admin_token=args.admin_token, device=args.engine_device, max_batch=args.engine_max_batch,
                       max_body_bytes=max(args.max_body_bytes, 8 * 1024 * 1024))


def _replica(args: argparse.Namespace) -> int:
    if args.task == "embed":
        from handler.embed.app import run as run_embed  # lazy: the embedding worker's app (litestar, torch)

        run_embed(build_embed_config(args), log_level=args.log_level)
        return 0
    from handler.serving.app import run  # lazy: the replica's app (litestar, the engine), not for `lorafarm --help`

    # compiled kernels (C and inductor's) kept across restarts and shared by a farm's replicas
    from handler.model import compile_cache  # lazy: imports torch, not for `lorafarm --help`

    compile_cache.use(args.cache_dir)
    config = build_config(args)
    run(config, log_level=args.log_level)
    return 0
