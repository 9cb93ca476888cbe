"""`lorafarm registry` (serve the control plane) and the admin commands that talk to a running
registry: `lorafarm tenants create NAME`, `lorafarm adapters upload PEFT_DIR --tenant T [--alias A]`,
`lorafarm aliases set ALIAS ADAPTER_ID`, `lorafarm aliases rollback ALIAS`, and the progressive
deploys of issue 38: `lorafarm aliases split|promote|rollout|rollouts|rollout-abort|metrics|versions`.
Every admin command goes through the Python client (`lorafarm.client.LorafarmClient`).

Admin commands take the registry URL and admin token from --registry-url / --admin-token, else
$LORAFARM_REGISTRY_URL / $LORAFARM_ADMIN_TOKEN, else farm.json (--farm, $LORAFARM_FARM_JSON,
./var/farm.json)."""

from __future__ import annotations

import argparse
import json
import sys

from lorafarm.errors import CliError


# -- lorafarm registry -------------------------------------------------------------------------


def _base_model(value: str) -> tuple[str, str]:
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME=DIR")
    return name, folder


def _admin_token(state_dir) -> str:
    """A token for a registry started without one: kept in <state-dir>/admin-token (mode 0600)."""
    import os
    import secrets
    from pathlib import Path

    path = Path(state_dir) / "admin-token"
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"lorafarm registry: no --admin-token given; generated one in {path}", file=sys.stderr)
    return token


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    import uvicorn

    from registry.settings import RegistrySettings

    for name, folder in args.base_model:
        if not Path(folder, "config.json").is_file():
            raise CliError(f"--base-model {name}={folder}: no config.json there")
    if args.rank_limit < 1:
        raise CliError("--rank-limit must be at least 1")
    if args.owners_k < 1:
        raise CliError("--owners-k must be at least 1")
    if not args.rollout_tick > 0:
        raise CliError("--rollout-tick must be positive")
    if args.replica_capacity <= 0 or args.replica_timeout <= 0:
        raise CliError("--replica-capacity and --replica-timeout must be positive")
    settings = RegistrySettings.from_env(
        state_dir=args.state_dir,
        database_url=args.database_url,
        store_url=args.store_url,
        s3_endpoint_url=args.s3_endpoint_url,
        admin_token=args.admin_token,
        signing_key=args.signing_key,
        base_models=dict(args.base_model) or None,
        rank_limit=args.rank_limit,
        owners_k=args.owners_k,
        replica_capacity_tokens_per_s=args.replica_capacity,
        replica_timeout_s=args.replica_timeout,
        rollout_tick_s=args.rollout_tick,
    )
    if not settings.admin_token:
        settings.admin_token = _admin_token(settings.state_dir)
    if not (settings.store_url.startswith(("file://", "s3://", "/"))):
        raise CliError(f"--store-url {settings.store_url!r}: use file:///abs/dir or s3://bucket/prefix")
    from registry.app import create_app

    import logging

    from lorafarm.accesslog import quiet_polling_loggers

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_polling_loggers()
    app = create_app(settings)
    # lorafarm.access logs each request (polls at DEBUG) and lorafarm.audit each change.
    # On SIGTERM uvicorn waits for open connections and background tasks: the replicas' and the
    # router's long polls of the routing table held a stop for ~14 s. The registry keeps no state in
    # them, so 3 s is enough grace.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=3)
    return 0


# -- admin commands ----------------------------------------------------------------------------


def _client(args):
    from lorafarm.client import LorafarmClient
    from lorafarm.settings import registry_connection

    url, token = registry_connection(args.registry_url, args.admin_token, args.farm)
    if not token:
        raise CliError("no admin token: pass --admin-token, set LORAFARM_ADMIN_TOKEN, or run `lorafarm up` (farm.json)")
    return LorafarmClient(url, token)


def _call(args, fn):
    """`fn(client)` with the blocking client; a registry error becomes a one-line CLI error."""
    from lorafarm.client import LorafarmError

    try:
        with _client(args) as reg:
            return fn(reg)
    except LorafarmError as e:
        raise CliError(e.message if e.status == 0 else f"{e.message} (HTTP {e.status})") from None


def _tenants_create(args) -> int:
    out = _call(args, lambda reg: reg.create_tenant(args.name, args.requests_per_s, args.tokens_per_s))
    print(f"tenant {out['tenant_id']} created; API key {out['key_id']} (shown only now):", file=sys.stderr)
    print(out["api_key"])
    return 0


def _tenants_list(args) -> int:
    print(json.dumps(_call(args, lambda reg: reg.list_tenants()), indent=1))
    return 0


def _limit(value: str) -> float | None:
    if value.strip().lower() in ("none", "unlimited"):
        return None
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number (or 'none': unlimited)") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a limit must be 0 or more")
    return v


def _weight(value: str) -> float | None:
    if value.strip().lower() in ("none", "default"):
        return None
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number (or 'none': the default, 1)") from None
    if not 0 < v <= 1024:
        raise argparse.ArgumentTypeError(f"{value!r}: a weight must be > 0 and <= 1024")
    return v


def _tenants_set_limits(args) -> int:
    limits = {k: v for k, v in (("requests_per_s", args.requests_per_s), ("tokens_per_s", args.tokens_per_s),
                                ("weight", args.weight)) if v is not _UNSET}
    if not limits:
        raise CliError("give --requests-per-s, --tokens-per-s (a number, or 'none' for unlimited) and/or --weight "
                       "(a number, or 'none' for 1)")
    out = _call(args, lambda reg: reg.set_tenant_limits(args.name, **limits))

    def show(v):
        return "unlimited" if v is None else f"{v:g}"

    weight = out.get("weight")
    print(f"tenant {out['tenant_id']}: requests_per_s {show(out['requests_per_s'])}, "
          f"tokens_per_s {show(out['tokens_per_s'])}, weight {1 if weight is None else f'{weight:g}'} "
          f"(routers apply it within their key cache TTL)")
    return 0


def _keys_create(args) -> int:
    out = _call(args, lambda reg: reg.create_key(args.tenant))
    print(f"API key {out['key_id']} of {args.tenant} (shown only now):", file=sys.stderr)
    print(out["api_key"])
    return 0


def _keys_list(args) -> int:
    print(json.dumps(_call(args, lambda reg: reg.list_keys(args.tenant)), indent=1))
    return 0


def _keys_rotate(args) -> int:
    out = _call(args, lambda reg: reg.rotate_keys(args.tenant, args.key_id))
    revoked = ", ".join(out.get("revoked_key_ids") or []) or "none"
    print(f"new API key {out['key_id']} of {args.tenant} (shown only now); revoked: {revoked}", file=sys.stderr)
    print(out["api_key"])
    return 0


def _keys_revoke(args) -> int:
    _call(args, lambda reg: reg.revoke_key(args.tenant, args.key_id))
    print(f"revoked {args.key_id} of {args.tenant} (every router polling the registry refuses it now)")
    return 0


def _adapters_status(args) -> int:  # disable | enable
    change = {"disable": "disable_adapter", "enable": "enable_adapter"}[args.action]
    out = _call(args, lambda reg: getattr(reg, change)(args.adapter_id))
    print(f"{out['adapter_id']}: {out['status']}")
    return 0


def _adapters_delete(args) -> int:
    _call(args, lambda reg: reg.delete_adapter(args.adapter_id))
    print(f"deleted {args.adapter_id}")
    return 0


def _aliases_delete(args) -> int:
    _call(args, lambda reg: reg.delete_alias(args.alias))
    print(f"deleted alias {args.alias}")
    return 0


def _audit(args) -> int:
    rows = _call(args, lambda reg: reg.audit(args.target, action=args.action, limit=args.limit))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        detail = " ".join(f"{k}={v}" for k, v in sorted(r["detail"].items()))
        print(f"{r['at']}  {r['actor']}  {r['action']}  {r['target']}  {detail}".rstrip())
    return 0


_UNSET = object()


def _adapters_upload(args) -> int:
    from pathlib import Path

    if not Path(args.peft_dir).exists():
        raise CliError(f"{args.peft_dir}: no such folder or file")
    base_hash = args.base_hash
    if args.trained_on:
        from archives.basehash import base_model_hash
        from archives.errors import ArchiveError

        try:
            base_hash = base_model_hash(args.trained_on, progress=True)
        except ArchiveError as e:
            raise CliError(f"--trained-on: {e}") from None
    out = _call(args, lambda reg: reg.upload_adapter(args.peft_dir, args.tenant, alias=args.alias,
                                                      base_model=args.base_model, base_model_hash=base_hash,
                                                      assume_base=args.assume_base, tags=dict(args.tag) or None))
    note = "registered" if out.get("created", True) else "already registered"
    alias = f"; alias {out['alias']}" if out.get("alias") else ""
    print(f"{note}: rank {out['rank']}, {out['size_bytes']} bytes, {out['weights_uri']}{alias}", file=sys.stderr)
    print(out["adapter_id"])
    return 0


def _tag(value: str) -> tuple[str, object]:
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE")
    import math

    for cast in (int, float):
        try:
            number = cast(raw)
        except ValueError:
            continue
        if math.isfinite(number):
            return key, number
    return key, raw


def _adapters_list(args) -> int:
    print(json.dumps(_call(args, lambda reg: reg.list_adapters(args.tenant)), indent=1))
    return 0


def _show_alias(out) -> None:
    split = out.get("split")
    target = " / ".join(f"{t['adapter_id']} {t['weight']:g}%" for t in split) if split else out["adapter_id"]
    print(f"{out['alias']} -> {target} (previous: {out['previous_adapter_id'] or 'none'})")


def _aliases_set(args) -> int:
    _show_alias(_call(args, lambda reg: reg.set_alias(args.alias, args.adapter_id)))
    return 0


def _aliases_rollback(args) -> int:
    _show_alias(_call(args, lambda reg: reg.rollback_alias(args.alias)))
    return 0


def _split_target(value: str) -> tuple[str, float]:
    adapter_id, sep, weight = value.rpartition("=")
    try:
        w = float(weight)
    except ValueError:
        w = float("nan")
    if not sep or not adapter_id or not 0 < w <= 100:
        raise argparse.ArgumentTypeError(f"{value!r} is not ADAPTER_ID=PERCENT (e.g. ad-...=10)")
    return adapter_id, w


def _aliases_split(args) -> int:
    _show_alias(_call(args, lambda reg: reg.split_alias(args.alias, args.targets)))
    return 0


def _aliases_promote(args) -> int:
    _show_alias(_call(args, lambda reg: reg.promote_alias(args.alias, args.adapter_id)))
    return 0


def _steps(value: str) -> list[int]:
    try:
        steps = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a list of percents like 10,50,100") from None
    if not steps:
        raise argparse.ArgumentTypeError("give the steps as percents, e.g. 10,50,100")
    return steps


def _duration(value: str) -> float:
    from lorafarm.client import parse_duration

    try:
        return parse_duration(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _show_rollout(r, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(r, indent=1))
        return
    steps = ",".join(str(x) for x in r["steps"])
    line = (f"rollout {r['rollout_id']} of {r['alias']}: {r['old_adapter_id']} -> {r['new_adapter_id']} "
            f"{r['state']} at {r['percent']}% (steps {steps}, every {r['interval_s']:g} s)")
    print(line)
    if r.get("reason"):
        print(f"  {r['reason']}")
    elif (r.get("last_evaluation") or {}).get("reason"):
        print(f"  {r['last_evaluation']['reason']}")


def _aliases_rollout(args) -> int:
    bounds = {"max_error_rate_increase": args.max_error_rate_increase, "max_ttft_p95_ratio": args.max_ttft_ratio,
              "ttft_slack_s": args.ttft_slack, "min_requests": args.min_requests,
              "min_ttft_samples": args.min_ttft_samples}

    def run(reg):
        r = reg.start_rollout(args.alias, args.adapter_id, steps=args.steps, interval=args.interval, bounds=bounds)
        _show_rollout(r, args.json)
        if args.wait:
            r = reg.wait_rollout(r["rollout_id"], poll_s=min(5.0, max(0.5, args.interval / 10)))
            _show_rollout(r, args.json)
        return r

    r = _call(args, run)
    return 0 if not args.wait or r["state"] == "promoted" else 1


def _aliases_rollouts(args) -> int:
    rows = _call(args, lambda reg: reg.list_rollouts(args.alias, args.state, args.limit))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        _show_rollout(r)
    return 0


def _running_rollout(reg, alias: str):
    from lorafarm.client import NotFoundError

    rows = reg.list_rollouts(alias, "running", 1)
    if not rows:
        raise NotFoundError(404, f"no rollout is running on {alias}")
    return rows[0]


def _aliases_rollout_abort(args) -> int:
    _show_rollout(_call(args, lambda reg: reg.abort_rollout(_running_rollout(reg, args.alias)["rollout_id"])))
    return 0


def _aliases_metrics(args) -> int:
    out = _call(args, lambda reg: reg.alias_metrics(args.alias, window_s=None if args.step else args.window,
                                                    rollout_step=args.step))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['alias']} from {out['since']} to {out['until']}")
    if not out["versions"]:
        print("  no traffic counted (routers count the versions of split aliases and push every stats window)")
    for aid, v in out["versions"].items():
        def pct(x):
            return "-" if x is None else f"{100 * x:.2f}%"

        def ms(x):
            return "-" if x is None else f"{1000 * x:.0f} ms"

        kinds = ",".join(f"{k}={n}" for k, n in v["error_kinds"].items()) or "-"
        print(f"  {aid}: {v['requests']} requests, errors {v['errors']} ({pct(v['error_rate'])}; {kinds}), "
              f"cancels {pct(v['cancel_rate'])}, TTFT p50 {ms(v['ttft_p50_s'])} p95 {ms(v['ttft_p95_s'])} "
              f"({v['ttft_count']} streamed), tokens {v['prompt_tokens']}+{v['completion_tokens']}, "
              f"finish {v['finish_reasons'] or '-'}")
    return 0


def _aliases_versions(args) -> int:
    rows = _call(args, lambda reg: reg.versions(args.alias))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for v in rows:
        a = v["adapter"]
        tags = " ".join(f"{k}={val}" for k, val in sorted((a.get("tags") or {}).items()))
        print(f"v{a['version']}\t{a['adapter_id']}\t{v['role']}\t{v['weight']:g}%\t{a['status']}\t{tags}".rstrip())
    return 0


def _aliases_get(args) -> int:
    print(json.dumps(_call(args, lambda reg: reg.get_alias(args.alias)), indent=1))
    return 0


def _workers_add(args) -> int:
    import re

    if args.weight <= 0:
        raise CliError("--weight must be positive")
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", args.url):
        raise CliError(f"--url {args.url!r}: expected http(s)://host[:port][/path]")
    from lorafarm.limits import worker_key_env_error

    if args.api_key_env is not None and (why := worker_key_env_error(args.api_key_env)):
        raise CliError("--" + why.replace("_", "-", 2))
    out = _call(args, lambda reg: reg.put_worker(args.name, args.url, args.kind, args.api_key_env, args.weight))
    secret = f"; the router reads its key from ${out['api_key_env']}" if out.get("api_key_env") else ""
    print(f"worker {out['name']} ({out['kind']}) at {out['url']}, weight {out['weight']:g}{secret}")
    return 0


def _workers_list(args) -> int:
    rows = _call(args, lambda reg: reg.list_workers())
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for w in rows:
        print(f"{w['name']}\t{w['kind']}\t{w['url']}\tweight={w['weight']:g}\tkey_env={w['api_key_env'] or '-'}")
    return 0


def _workers_remove(args) -> int:
    _call(args, lambda reg: reg.delete_worker(args.name))
    print(f"worker {args.name} removed")
    return 0


def _models_critical(args) -> int:
    rows = _call(args, lambda reg: reg.set_critical(args.name, not args.off))
    names = [r["model"] for r in rows]
    state = "no longer critical" if args.off else "latency-critical (kept on at least two healthy workers)"
    print(f"{args.name}: {state}; critical models: {', '.join(names) or 'none'}")
    return 0


def _connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry-url", default=None, help="registry URL (default $LORAFARM_REGISTRY_URL, farm.json)")
    p.add_argument("--admin-token", default=None, help="admin token (default $LORAFARM_ADMIN_TOKEN, farm.json)")
    p.add_argument("--farm", default=None, help="farm.json written by `lorafarm up` (default ./var/farm.json)")


def _command(group, name: str, help: str, func, *positionals: str) -> argparse.ArgumentParser:
    """One admin command: its positional arguments, the connection flags, its handler."""
    p = group.add_parser(name, help=help)
    for arg in positionals:
        p.add_argument(arg)
    _connection_flags(p)
    p.set_defaults(func=func)
    return p


def _group(sub, name: str, help: str):
    p = sub.add_parser(name, help=help)
    inner = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    inner.required = True
    return inner


def register(sub) -> None:
    p = sub.add_parser("registry", help="serve the registry (control plane) with uvicorn")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="listen port (default 8100)")
    p.add_argument("--state-dir", default=None, help="default folder of the database, store and keys (var)")
    p.add_argument("--database-url", default=None, help="SQLAlchemy async URL (default $LORAFARM_DATABASE_URL, "
                   "else sqlite in the state dir)")
    p.add_argument("--store-url", default=None, help="file:///abs/dir or s3://bucket/prefix (default $LORAFARM_STORE_URL)")
    p.add_argument("--s3-endpoint-url", default=None, help="S3-compatible endpoint (default $LORAFARM_S3_ENDPOINT_URL)")
    p.add_argument("--admin-token", default=None, help="bearer token of /internal/* (default $LORAFARM_ADMIN_TOKEN)")
    p.add_argument("--signing-key", default=None, help="Ed25519 private key PEM (default $LORAFARM_SIGNING_KEY; "
                   "generated when missing)")
    p.add_argument("--base-model", action="append", type=_base_model, default=[], metavar="NAME=DIR",
                   help="a served base model (repeatable)")
    p.add_argument("--rank-limit", type=int, default=64, help="highest adapter rank accepted (default 64)")
    p.add_argument("--owners-k", type=int, default=2, help="default owner replicas per adapter (default 2)")
    p.add_argument("--replica-capacity", type=float, default=640.0,
                   help="tokens/s one replica serves of one adapter; owner counts grow past it (default 640)")
    p.add_argument("--replica-timeout", type=float, default=30.0, help="seconds without heartbeat before down (30)")
    p.add_argument("--rollout-tick", type=float, default=1.0,
                   help="seconds between evaluations of the running rollouts (default 1)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    p.set_defaults(func=_serve)

    tenants = _group(sub, "tenants", "manage tenants of a running registry")
    p = tenants.add_parser("create", help="create a tenant; prints its API key once")
    p.add_argument("name", help="tenant id (a slug: [a-z0-9][a-z0-9-]{1,62})")
    p.add_argument("--requests-per-s", type=float, default=None)
    p.add_argument("--tokens-per-s", type=float, default=None)
    _connection_flags(p)
    p.set_defaults(func=_tenants_create)
    p = tenants.add_parser("list", help="list tenants (JSON)")
    _connection_flags(p)
    p.set_defaults(func=_tenants_list)
    p = tenants.add_parser("set-limits", help="change a tenant's rate limits ('none': unlimited) or weight")
    p.add_argument("name", help="tenant id")
    p.add_argument("--requests-per-s", type=_limit, default=_UNSET, metavar="R")
    p.add_argument("--tokens-per-s", type=_limit, default=_UNSET, metavar="T")
    p.add_argument("--weight", type=_weight, default=_UNSET, metavar="W",
                   help="fair-scheduling weight: the tenant's share of a replica's batch relative to other tenants' "
                        "(default 1; 'none': back to 1)")
    _connection_flags(p)
    p.set_defaults(func=_tenants_set_limits)

    keys = _group(sub, "keys", "create, list, rotate and revoke tenants' API keys")
    _command(keys, "create", "a new API key for TENANT (printed once)", _keys_create, "tenant")
    _command(keys, "list", "TENANT's keys (prefixes only; JSON)", _keys_list, "tenant")
    p = _command(keys, "rotate", "a new key for TENANT (printed once); revokes KEY_ID, or every live key",
                 _keys_rotate, "tenant")
    p.add_argument("key_id", nargs="?", default=None)
    _command(keys, "revoke", "revoke KEY_ID of TENANT", _keys_revoke, "tenant", "key_id")

    p = sub.add_parser("audit", help="who changed which tenant, key, adapter or alias, and when (newest first)")
    p.add_argument("--target", default=None, help="one tenant, key id, adapter id or alias")
    p.add_argument("--action", default=None, help="e.g. alias.set, adapter.delete, key.rotate")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--json", action="store_true")
    _connection_flags(p)
    p.set_defaults(func=_audit)

    adapters = _group(sub, "adapters", "upload, list, disable and delete adapters")
    p = adapters.add_parser("upload", help="upload a PEFT adapter folder (or tar); prints the adapter id")
    p.add_argument("peft_dir", help="folder with adapter_config.json + adapter_model.safetensors, or a tar of one")
    p.add_argument("--tenant", required=True, help="owning tenant id")
    p.add_argument("--alias", default=None, help="also point this alias (<tenant>/<name>:<tag>) at it")
    p.add_argument("--base-model", default=None, help="served base model name or hash (default: the only one)")
    trained = p.add_mutually_exclusive_group()
    trained.add_argument("--base-hash", default=None, metavar="sha256:...",
                         help="hash of the base it was trained on (`lorafarm archive basehash DIR`); default: "
                         "base_model_hash.txt beside the adapter")
    trained.add_argument("--trained-on", default=None, metavar="BASE_DIR",
                         help="the base folder it was trained on (its hash is sent)")
    trained.add_argument("--assume-base", action="store_true",
                         help="no base hash: trust that the adapter was trained on the chosen base")
    p.add_argument("--tag", action="append", default=[], type=_tag, metavar="KEY=VALUE",
                   help="kept with the version (run name, step, eval metrics...); repeatable")
    _connection_flags(p)
    p.set_defaults(func=_adapters_upload)
    from loadtests.cli import add_synth_parser

    add_synth_parser(adapters, _connection_flags)
    p = adapters.add_parser("list", help="list adapters (JSON)")
    p.add_argument("--tenant", default=None)
    _connection_flags(p)
    p.set_defaults(func=_adapters_list)
    _command(adapters, "disable", "stop serving ADAPTER_ID (404 at the router; replicas unload it when idle)",
             _adapters_status, "adapter_id")
    _command(adapters, "enable", "serve a disabled ADAPTER_ID again", _adapters_status, "adapter_id")
    _command(adapters, "delete", "delete ADAPTER_ID and its archive (refused while an alias points to it)",
             _adapters_delete, "adapter_id")

    aliases = _group(sub, "aliases", "deploy and roll back aliases")
    p = aliases.add_parser("set", help="deploy: point ALIAS at ADAPTER_ID")
    p.add_argument("alias")
    p.add_argument("adapter_id")
    _connection_flags(p)
    p.set_defaults(func=_aliases_set)
    p = aliases.add_parser("rollback", help="point ALIAS back at its previous adapter")
    p.add_argument("alias")
    _connection_flags(p)
    p.set_defaults(func=_aliases_rollback)
    _command(aliases, "delete", "delete ALIAS (its adapters stay)", _aliases_delete, "alias")
    p = aliases.add_parser("get", help="show ALIAS (JSON)")
    p.add_argument("alias")
    _connection_flags(p)
    p.set_defaults(func=_aliases_get)
    p = aliases.add_parser("split", help="split ALIAS's traffic by weight: ADAPTER_ID=PERCENT ... (summing to 100)")
    p.add_argument("alias")
    p.add_argument("targets", nargs="+", type=_split_target, metavar="ADAPTER_ID=PERCENT")
    _connection_flags(p)
    p.set_defaults(func=_aliases_split)
    p = aliases.add_parser("promote", help="end ALIAS's split: all traffic to ADAPTER_ID (default: the split's other "
                           "version)")
    p.add_argument("alias")
    p.add_argument("adapter_id", nargs="?", default=None)
    _connection_flags(p)
    p.set_defaults(func=_aliases_promote)
    p = aliases.add_parser("rollout", help="progressive deploy of NEW on ALIAS, run by the registry: promoted step by "
                           "step while within bounds, rolled back automatically when not")
    p.add_argument("alias")
    p.add_argument("adapter_id", metavar="NEW", help="the new version (adapter id)")
    p.add_argument("--steps", type=_steps, default=[10, 50, 100], help="percent of traffic per step (default "
                   "10,50,100; the last is 100: the promotion)")
    p.add_argument("--interval", type=_duration, default=300.0, help="each step lasts at least this (30s, 5m, 1h; "
                   "default 5m)")
    p.add_argument("--max-error-rate-increase", type=float, default=None, metavar="F",
                   help="new error rate <= old + F (default 0.02)")
    p.add_argument("--max-ttft-ratio", type=float, default=None, metavar="R",
                   help="new p95 TTFT <= old p95 x R + slack (default 1.5)")
    p.add_argument("--ttft-slack", type=_duration, default=None, metavar="S", help="added to the TTFT bound (0.05s)")
    p.add_argument("--min-requests", type=int, default=None, metavar="N",
                   help="requests on the new version in a step before promoting or failing it (default 50)")
    p.add_argument("--min-ttft-samples", type=int, default=None, metavar="N",
                   help="streamed requests per version before the TTFT bound is judged (default 30)")
    p.add_argument("--wait", action="store_true", help="wait for the end; exit 0 only when promoted")
    p.add_argument("--json", action="store_true")
    _connection_flags(p)
    p.set_defaults(func=_aliases_rollout)
    p = aliases.add_parser("rollouts", help="rollouts, newest first (optionally of ALIAS)")
    p.add_argument("alias", nargs="?", default=None)
    p.add_argument("--state", default=None, choices=["running", "promoted", "rolled_back", "aborted"])
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true")
    _connection_flags(p)
    p.set_defaults(func=_aliases_rollouts)
    _command(aliases, "rollout-abort", "stop the rollout running on ALIAS (all traffic back to the old version)",
             _aliases_rollout_abort, "alias")
    p = aliases.add_parser("metrics", help="per-version traffic of ALIAS (requests, errors, TTFT, tokens, cancels)")
    p.add_argument("alias")
    p.add_argument("--window", type=_duration, default=300.0, help="over the last WINDOW (default 5m)")
    p.add_argument("--step", action="store_true", help="over the running rollout's current step")
    p.add_argument("--json", action="store_true")
    _connection_flags(p)
    p.set_defaults(func=_aliases_metrics)
    p = aliases.add_parser("versions", help="the versions of ALIAS's tenant and their role and share in ALIAS")
    p.add_argument("alias")
    p.add_argument("--json", action="store_true")
    _connection_flags(p)
    p.set_defaults(func=_aliases_versions)

    workers = _group(sub, "workers", "foreign workers: OpenAI-compatible servers or Ollama the router also routes to")
    p = workers.add_parser("add", help="register (or update) a foreign worker")
    p.add_argument("name", help="worker name ([A-Za-z0-9._-], up to 63)")
    p.add_argument("--url", required=True, help="base URL, e.g. http://gpu-box:8000 (without /v1)")
    p.add_argument("--kind", required=True, choices=["openai", "ollama"],
                   help="openai: any OpenAI-compatible server (vLLM, transformers serve, llama.cpp); ollama")
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="the router's environment variable holding the worker's API key, named "
                        "LORAFARM_WORKER_KEY_<NAME> (any other name is refused; the key is never stored)")
    p.add_argument("--weight", type=float, default=1.0, help="capacity weight for the weighted strategy (default 1)")
    _connection_flags(p)
    p.set_defaults(func=_workers_add)
    p = workers.add_parser("list", help="list foreign workers")
    p.add_argument("--json", action="store_true")
    _connection_flags(p)
    p.set_defaults(func=_workers_list)
    p = workers.add_parser("remove", help="remove a foreign worker")
    p.add_argument("name")
    _connection_flags(p)
    p.set_defaults(func=_workers_remove)

    models = _group(sub, "models", "model-level settings of the farm")
    p = models.add_parser("critical", help="mark a model latency-critical: degraded while < 2 healthy workers hold it")
    p.add_argument("name", help="model name as /v1/models lists it")
    p.add_argument("--off", action="store_true", help="unmark it")
    _connection_flags(p)
    p.set_defaults(func=_models_critical)
