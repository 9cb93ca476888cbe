"""`lorafarm simulate`: the fleet simulator (loadtests.simulate) from the command line.

With `--json` the last line printed is one JSON object with at least p95_ttft_s, p50_ttft_s,
device_hit_rate, evictions_per_min and replicas (DESIGN.md section 7). `--sweep KEY=V1,V2,...`
runs one simulation per value and prints one line each (a JSON list last with --json)."""

from __future__ import annotations

import argparse
import json
import math

from lorafarm.errors import CliError

SWEEPABLE = ("replicas", "slots", "rate", "adapters", "zipf_s", "hot_tokens_per_s", "owners_k", "system_prompt_share",
             "prefix_cache_tokens")


def _load_ms(text: str) -> dict[str, float]:
    out = {}
    try:
        for part in text.split(","):
            tier, ms = part.split("=")
            if tier not in ("ram", "disk", "remote"):
                raise ValueError
            out[tier] = float(ms) / 1000
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a load-time list: {text!r} (e.g. ram=8,disk=40,remote=400)") from None
    return out


def _sweep(text: str) -> tuple[str, list[float]]:
    try:
        key, values = text.split("=", 1)
        key = key.replace("-", "_")
        vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sweep: {text!r} (e.g. replicas=16,20,26)") from None
    if key not in SWEEPABLE or not vals:
        raise argparse.ArgumentTypeError(f"--sweep KEY is one of {', '.join(SWEEPABLE)}")
    return key, vals


def config_from_args(args: argparse.Namespace):
    from loadtests.simulate import AutoscaleConfig, SimConfig, diurnal, seed_config

    base = SimConfig()
    load_s = dict(base.load_s)
    load_s.update(args.load_ms or {})
    kw = dict(replicas=args.replicas, adapters=args.adapters, rate=args.rate, duration=args.duration,
              warmup_s=min(args.warmup, args.duration / 2), slots=args.slots, routing=args.routing,
              zipf_s=args.zipf, seed=args.seed, hot_tokens_per_s=args.hot_tokens_per_s, load_s=load_s,
              prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
              decode_step_s=args.decode_step_s, decode_step_per_row_s=args.decode_step_per_row_s,
              prefill_tokens_per_s=args.prefill_tokens_per_s, max_batch=args.max_batch,
              load_threshold_tokens=args.load_threshold_tokens, owners_k=args.owners_k,
              system_prompt_share=args.system_prompt_share, system_prompt_tokens=args.system_prompt_tokens,
              prefix_cache=not args.no_prefix_cache, prefix_cache_tokens=args.prefix_cache_tokens,
              scheduling=args.scheduling, tenants=args.tenants, hostile_rate=args.hostile_rate,
              hostile_n=args.hostile_n, hostile_prompt_tokens=args.hostile_prompt_tokens,
              hostile_output_tokens=args.hostile_output_tokens, progress=not args.json and not args.quiet)
    if args.ram_adapters is not None:
        kw["ram_adapters"] = args.ram_adapters
    if args.trace:
        from loadtests.workload import read_trace

        try:
            kw["trace"] = tuple(read_trace(args.trace))
        except (OSError, ValueError, KeyError) as e:
            raise CliError(f"--trace {args.trace}: {e}") from None
    if args.diurnal:
        kw["rate_curve"] = diurnal(args.diurnal)
    if args.autoscale:
        kw["autoscale"] = AutoscaleConfig(min_replicas=args.min_replicas, max_replicas=args.max_replicas)
    return seed_config(**kw)


def _line(r) -> str:
    prefix = ""
    if r.config.get("system_prompt_share"):
        prefix = (f"prefix hit {100 * r.prefix_hit_rate:.1f}% of prompt tokens "
                  f"({100 * r.prefix_request_hit_rate:.1f}% of system-prompt requests"
                  + ("" if r.config.get("prefix_cache") else ", cache off") + ")  ")
    return (f"replicas {r.replicas} (mean {r.mean_replicas:.1f})  requests {r.requests}  "
            f"TTFT p50 {r.p50_ttft_s:.3f} s  p95 {r.p95_ttft_s:.3f} s  device hit {100 * r.device_hit_rate:.1f}%  "
            f"{prefix}evictions/min {r.evictions_per_min:.1f}  cost/M tokens {r.cost_per_m_tokens:.3f} USD  "
            f"(wall {r.wall_s:.1f} s)")


def _simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from loadtests.simulate import simulate

    try:
        cfg = config_from_args(args)
        cfg.check()
    except (ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    runs = []
    if args.sweep:
        key, values = args.sweep
        for v in values:
            c = replace(cfg, **{key: type(getattr(cfg, key))(v)})
            try:
                c.check()
            except ValueError as e:
                raise CliError(str(e)) from None
            r = simulate(c)
            runs.append({key: getattr(c, key), **r.summary()})
            if not args.json:
                print(f"{key}={getattr(c, key)}: " + _line(r))
        if args.json:
            print(json.dumps(_clean(runs)))
        return 0
    r = simulate(cfg)
    if args.json:
        print(json.dumps(_clean(r.summary())))
    else:
        print(_line(r))
        for tier, t in r.ttft_by_tier.items():
            print(f"  {tier:6s} {100 * r.tier_share[tier]:5.1f}% of requests  p50 {t['p50_s']:.3f} s  p95 {t['p95_s']:.3f} s")
        if r.hot:
            print(f"  hot tenant: {r.hot}")
        for name, t in (r.tenants or {}).items():
            print(f"  tenant {name:8s} {t['rows']:6d} rows  TTFT p50 {t['p50_ttft_s']:.3f} s  "
                  f"p95 {t['p95_ttft_s']:.3f} s  max {t['max_ttft_s']:.3f} s  {t['output_tokens_per_s']:.1f} output tok/s  "
                  f"unfinished {t['unfinished']}")
        if r.tenants:
            print(f"  share preemptions: {r.preemptions} ({r.config['scheduling']} scheduling)")
    return 0


def _clean(x):
    """JSON without NaN/inf (null instead)."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def register(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event fleet simulator on the real routing and slot-policy code",
                       description="Simulate a fleet (defaults: the seed's 26 replicas, 5,000 adapters, 40 req/s, "
                                   "250 slots) with the router's choose() and the replica's slot policy.")
    p.add_argument("--replicas", type=int, default=26)
    p.add_argument("--adapters", type=int, default=5000)
    p.add_argument("--rate", type=float, default=40.0, help="requests/s (the peak with --diurnal)")
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals (default 600)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the results (default 60)")
    p.add_argument("--slots", type=int, default=250, help="device slots per replica (default 250)")
    p.add_argument("--routing", choices=["affinity", "random"], default="affinity")
    p.add_argument("--owners-k", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the adapter mix (default 1.1)")
    p.add_argument("--prompt-tokens", type=float, default=750.0, help="mean prompt tokens (default 750)")
    p.add_argument("--output-tokens", type=float, default=250.0, help="mean output tokens (default 250)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--decode-step-s", type=float, default=0.05, help="decode step time (default 0.05)")
    p.add_argument("--decode-step-per-row-s", type=float, default=0.0, help="extra step time per batch row")
    p.add_argument("--prefill-tokens-per-s", type=float, default=8000.0)
    p.add_argument("--load-ms", type=_load_ms, default=None, metavar="ram=8,disk=40,remote=400",
                   help="adapter load time per tier in ms (default the seed's)")
    p.add_argument("--ram-adapters", type=int, default=None, help="host RAM tier in adapters (default 385)")
    p.add_argument("--load-threshold-tokens", type=int, default=32_000,
                   help="router overload threshold, tokens in flight (default 32000: 32 x 1000-token requests)")
    p.add_argument("--trace", default=None, metavar="CSV",
                   help="arrival gaps (scaled to --rate) and lengths from an Azure LLM trace CSV "
                        "(TIMESTAMP,ContextTokens,GeneratedTokens; loadtests.workload.read_trace)")
    p.add_argument("--hot-tokens-per-s", type=float, default=0.0, help="add a hot tenant at this many output tok/s")
    p.add_argument("--system-prompt-share", type=float, default=0.0,
                   help="share of requests carrying their adapter's shared system prompt (default 0: none)")
    p.add_argument("--system-prompt-tokens", type=float, default=500.0,
                   help="mean system prompt tokens, drawn once per adapter (log-normal; default 500), added to the "
                        "request's own prompt")
    p.add_argument("--no-prefix-cache", action="store_true", help="replicas without a prefix cache")
    p.add_argument("--prefix-cache-tokens", type=int, default=32_000,
                   help="prefix tokens each replica's cache keeps, LRU (default 32000)")
    p.add_argument("--scheduling", choices=["fair", "fifo"], default="fair",
                   help="each replica's batch admission: fair by tenant (handler.engine.fairness, the "
                        "default, as the replica) or fifo")
    p.add_argument("--tenants", type=int, default=0,
                   help="adapter i belongs to tenant t{i %% N} (default 0: one anonymous tenant); per-tenant "
                        "TTFT is reported")
    p.add_argument("--hostile-rate", type=float, default=0.0,
                   help="add a hostile tenant sending this many requests/s of --hostile-n rows each")
    p.add_argument("--hostile-n", type=int, default=16,
                   help="rows (n choices) per hostile request (default 16)")
    p.add_argument("--hostile-prompt-tokens", type=int, default=50)
    p.add_argument("--hostile-output-tokens", type=int, default=600)
    p.add_argument("--diurnal", type=float, default=None, metavar="PERIOD_S",
                   help="rate follows a day compressed into PERIOD_S seconds (25%% .. 100%% of --rate)")
    p.add_argument("--autoscale", action="store_true", help="HPA on queue depth and tokens in flight (deploy/)")
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--max-replicas", type=int, default=64)
    p.add_argument("--sweep", type=_sweep, default=None, metavar="KEY=V1,V2,...",
                   help=f"one run per value; KEY one of {', '.join(SWEEPABLE)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="last line: one JSON object (a list with --sweep)")
    p.set_defaults(func=_simulate)
