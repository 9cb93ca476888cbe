"""`lorafarm loadtest` (the locust suite, headless, as a rate sweep) and `lorafarm adapters synth`.

    lorafarm loadtest [--url URL --key KEY | --farm farm.json | --replicas N --adapters N --slots S[,S...]]
                      [--rates R1,R2,...] [--duration S] [--warmup S] [--zipf A] [--routing affinity|random]
                      [--ab [--ab-routings A,B] [--ab-rate R]] [--throughput] [--out DIR]
                      [--system-prompt-share F [--system-prompt-median W]] [--ab-prefix-cache]
    lorafarm loadtest --report-from DIR [--to docs]        # re-render a run's report (into docs/)

With neither --url nor --farm it starts a farm (registry, router, replicas: `lorafarm.farm.Farm`)
in --state-dir, uploads --adapters synthetic adapters through the registry, and stops every process
it started when done or interrupted. Each --slots value is one sweep (the farm restarted with that
many device slots per rank pool), so `--slots 8,2` shows where thrashing starts.

--ab replays the same seeded workload once per routing variant of --ab-routings (default
affinity,random), each on a fresh farm at the smallest --slots: affinity (the router's defaults:
warm/owner classes ordered by expected TTFT), class-order (warm/owner classes in the fixed order
gpu > ram > disk > owner: `lorafarm router --score class-order`, the rule before issue 13) and
random (`--strategy random --no-affinity`).

--ab-prefix-cache replaces the --slots sweeps by two sweeps of --rates over the same seeded workload,
each on a fresh farm at the (one) --slots value: `prefix-on` (the replicas' prefix cache, their
default) first, then `prefix-off` (every replica started with `lorafarm replica --no-prefix-cache`).
It needs shared system prompts (--system-prompt-share > 0). The k-th rate step draws its requests
with --seed + k in both sweeps (the same seed and rate replay the same requests in order, and a
cache still holding the previous step's whole prompts would serve those replays from it); the
adapters' system prompts stay those of --system-prompt-seed throughout. The report adds p95 TTFT per rate with
and without the cache, the highest rate each sustains (p95 TTFT < 1 s, zero errors), the prefix hit
rate from the replicas' lorafarm_prefix_cache_{queries,hits}_total (prompt tokens) and the cached
share of prompt tokens the answers reported (usage.prompt_tokens_details.cached_tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from loadtests.workload import add_workload_arguments
from lorafarm.errors import CliError

ROUTING_ARGS = {"affinity": [], "class-order": ["--score", "class-order"],
                "random": ["--strategy", "random", "--no-affinity"]}
THROUGHPUT_DISTINCT = (1, 8, 32)
TENANT = "loadtest"
NO_PREFIX_CACHE = "--no-prefix-cache"  # the replica's flag (handler/cli.py)
PREFIX_AB_RUNS = (("prefix-on", True), ("prefix-off", False))  # run name, replicas' prefix cache on


def _floats(value: str) -> list[float]:
    try:
        out = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of numbers") from None
    if not out:
        raise argparse.ArgumentTypeError("give at least one value")
    return out


def _ints(value: str) -> list[int]:
    out = _floats(value)
    if any(v != int(v) for v in out):
        raise argparse.ArgumentTypeError(f"{value!r}: whole numbers only")
    return [int(v) for v in out]


def _routings(value: str) -> list[str]:
    out = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    bad = [v for v in out if v not in ROUTING_ARGS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated variants of {', '.join(sorted(ROUTING_ARGS))}")
    return out


def _check(args: argparse.Namespace) -> None:
    """Bad input: one line, exit 2, before anything starts."""
    args.rates = list(dict.fromkeys(args.rates))  # a rate twice would overwrite its own step files
    args.slots = list(dict.fromkeys(args.slots))
    if any(r <= 0 or math.isinf(r) or math.isnan(r) for r in args.rates):
        raise CliError(f"--rates {','.join(f'{r:g}' for r in args.rates)}: every rate must be a positive number")
    for name in ("duration", "warmup", "throughput_duration"):
        value = getattr(args, name)
        if value < 0 or (name != "warmup" and value == 0):
            raise CliError(f"--{name.replace('_', '-')} {value:g}: must be positive")
    if args.adapters < 1:
        raise CliError(f"--adapters {args.adapters}: must be at least 1")
    if args.replicas < 1:
        raise CliError(f"--replicas {args.replicas}: must be at least 1")
    if any(s < 1 for s in args.slots):
        raise CliError(f"--slots {args.slots}: every value must be at least 1")
    if args.zipf <= 0:
        raise CliError(f"--zipf {args.zipf:g}: must be positive")
    if args.concurrency < 1:
        raise CliError(f"--concurrency {args.concurrency}: must be at least 1")
    if args.ab_rate is not None and args.ab_rate <= 0:
        raise CliError(f"--ab-rate {args.ab_rate:g}: must be positive")
    if args.url and not args.key:
        raise CliError("--url needs --key (a tenant API key)")
    if args.url and args.farm:
        raise CliError("give --url or --farm, not both")
    if (args.url or args.farm) and (args.ab or args.routing != "affinity" or len(args.slots) > 1):
        raise CliError("--ab, --routing other than affinity and several --slots need a farm this command starts "
                       "(drop --url/--farm)")  # fmt: skip
    if args.ab_prefix_cache:
        if args.url or args.farm:
            raise CliError("--ab-prefix-cache needs a farm this command starts (drop --url/--farm)")
        if args.ab:
            raise CliError("--ab-prefix-cache and --ab each start their own farms: run them one at a time")
        if len(args.slots) > 1:
            raise CliError(f"--ab-prefix-cache takes one --slots value, not {','.join(map(str, args.slots))}")
        if args.system_prompt_share <= 0:
            raise CliError("--ab-prefix-cache needs --system-prompt-share > 0 (without shared system prompts "
                           "there is nothing for the prefix cache to reuse)")  # fmt: skip
        if any(a.split("=")[0] == NO_PREFIX_CACHE for a in args.replica_arg):
            raise CliError(f"--ab-prefix-cache sets {NO_PREFIX_CACHE} itself: drop it from --replica-arg")
    from loadtests.workload import check_spec, spec_from_options, workload_options

    try:
        check_spec(spec_from_options(workload_options(args), 1.0, 1.0))
    except ValueError as e:
        raise CliError(f"workload: {e}") from None
    if args.trace and not Path(args.trace).is_file():
        raise CliError(f"--trace {args.trace}: no such file")
    if args.trace:
        from loadtests.workload import read_trace

        try:
            read_trace(args.trace)
        except (ValueError, KeyError) as e:
            raise CliError(f"--trace {args.trace}: {e}") from None


def _router_models(url: str, key: str) -> tuple[list[str], list[str]]:
    """(adapter models, base models) the router lists for this key; CliError on no answer or a bad key."""
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach the router at {url}: {type(e).__name__}: {e}") from None
    if r.status_code == 401:
        raise CliError(f"the router at {url} rejected the API key (HTTP 401)")
    if r.status_code != 200:
        raise CliError(f"{url}/v1/models answered HTTP {r.status_code}: is this a lorafarm router?")
    try:
        data = r.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise CliError(f"{url}/v1/models did not answer an OpenAI model list") from None
    adapters = [m["id"] for m in data if m.get("root") and m["id"] != m["root"]]
    adapters = adapters or [m["id"] for m in data if m.get("root")]
    bases = [m["id"] for m in data if not m.get("root")]
    return sorted(adapters), bases


def _wait_models(url: str, key: str, want: int, timeout: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        models, _ = _router_models(url, key)
        if len(models) >= want or time.monotonic() > deadline:
            return models
        time.sleep(0.5)


class _Session:
    """Where the load goes, and the farm behind it when this command started one."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.farm = None
        self.synth_line = ""

    def external_target(self):
        from loadtests.runner import Target
        from lorafarm.settings import load_farm_json

        a = self.args
        if a.url:
            url, key, replicas = a.url, a.key, []
        else:
            info = load_farm_json(a.farm)
            try:
                url = info["router_url"]
                key = a.key or info["tenants"][0]["api_key"]
            except (KeyError, IndexError, TypeError):
                raise CliError(f"--farm {a.farm}: no router_url / tenant API key in it") from None
            replicas = [r["url"] for r in info.get("replicas", []) if r.get("url")]
        models, bases = _router_models(url, key)
        if not models:
            raise CliError(f"the router at {url} lists no adapters for this key")
        return Target(url, key, models, replicas, bases[0] if bases else "")

    def start_farm(self, slots: int, routing: str | None = None, prefix_cache: bool = True):
        """(Re)start the farm with `slots` device slots per rank pool (and the replicas' prefix cache
        off when `prefix_cache` is false); synthetic adapters uploaded once."""
        import asyncio

        from loadtests.runner import Target
        from loadtests.synth import synth_upload
        from lorafarm.farm import BASE_MODEL_NAME, Farm, FarmPorts

        a = self.args
        if self.farm is not None:
            self.farm.stop()
        replica_args = ["--slots", str(slots), *a.replica_arg, *([] if prefix_cache else [NO_PREFIX_CACHE])]
        for attempt in range(3):  # a port found free can be taken by another program before we bind it
            self.farm = Farm(Path(a.state_dir), replicas=a.replicas, ports=FarmPorts.free(a.replicas),
                             demo_adapters=0, replica_args=replica_args, router_args=ROUTING_ARGS[routing or a.routing],
                             progress=not a.quiet)  # fmt: skip
            try:
                info = self.farm.up()
                break
            except CliError as e:
                self.farm.stop()
                if attempt == 2 or "address already in use" not in str(e):
                    raise
                print("lorafarm loadtest: a port was taken meanwhile; starting the farm again", file=sys.stderr)
        key_file = Path(a.state_dir) / "loadtest-key"
        res = asyncio.run(synth_upload(info["registry_url"], info["admin_token"], self.farm.model_dir, TENANT,
                                       a.adapters, a.ranks, a.targets, aliases=True, seed=a.seed,
                                       progress=not a.quiet))  # fmt: skip
        if res.api_key:
            key_file.write_text(res.api_key + "\n")
            key_file.chmod(0o600)
        if not key_file.exists():
            raise CliError(f"tenant {TENANT!r} exists but {key_file} is gone: use a fresh --state-dir")
        if not self.synth_line:
            self.synth_line = res.summary(TENANT)
            print(f"lorafarm loadtest: {self.synth_line}", file=sys.stderr)
        key = key_file.read_text().strip()
        want = sorted(res.aliases)
        listed = set(_wait_models(info["router_url"], key, len(want)))
        if not set(want) <= listed:
            raise CliError(f"the router lists {len(listed)} of the {len(want)} adapters after 120 s")
        replicas = [r["url"] for r in info["replicas"]]
        return Target(info["router_url"], key, want, replicas, BASE_MODEL_NAME)

    def stop(self) -> None:
        if self.farm is not None:
            self.farm.stop()
            self.farm = None


def _conditions() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "cpu"
    return (f"{os.cpu_count()} CPU cores, device {device}, load average {load:.1f} at start; load generator, "
            "router, registry and replicas share this machine")  # fmt: skip


def _step_rows(run: str, rate: float, csv_path: Path, metrics_dir: Path, meta: dict) -> list[dict]:
    from loadtests.runner import cache_rates, cpu_use, read_requests, summarize

    rates = {**cache_rates(metrics_dir), **cpu_use(metrics_dir)}
    rows = []
    for g in summarize(read_requests(csv_path), meta["duration"]):
        rows.append({"run": run, "rate": rate, **g, **rates, "replicas": meta["replicas"], "slots": meta["slots"],
                     "adapters": meta["adapters"], "routing": meta["routing"], "zipf": meta["zipf"],
                     "prompt_median_words": meta["prompt_median"], "prompt_sigma": meta["prompt_sigma"],
                     "output_median_tokens": meta["output_median"], "output_sigma": meta["output_sigma"],
                     "output_cap": meta["output_cap"], "warmup_s": meta["warmup"], "duration_s": meta["duration"],
                     "prefix_cache": meta.get("prefix_cache", "on"), "seed": meta.get("seed", ""),
                     "system_prompt_share": meta.get("system_prompt_share", 0.0),
                     "system_prompt_median_words": meta.get("system_prompt_median", "")})  # fmt: skip
    return rows


def _say_step(name: str, row: dict) -> None:
    prefix = row.get("prefix_hit_rate", math.nan)
    print(f"lorafarm loadtest: {name}: {row['requests']} requests, {row['errors']} errors, TTFT p50 "
          f"{row['ttft_p50_ms']:.0f} ms p95 {row['ttft_p95_ms']:.0f} ms, device hit "
          f"{100 * row['device_hit_rate']:.1f}%, evictions/min {row['evictions_per_min']:.1f}"
          + ("" if math.isnan(prefix) else f", prefix hit {100 * prefix:.1f}%"), file=sys.stderr)  # fmt: skip


def _loadtest(args: argparse.Namespace) -> int:
    if args.report_from:
        from loadtests.report import publish, write_report

        src = Path(args.report_from)
        if not (src / "sweep.csv").exists():
            raise CliError(f"--report-from {src}: no sweep.csv there")
        out = publish(src, Path(args.to)) if args.to else write_report(src)
        print(out)
        return 0
    _check(args)
    from loadtests.report import write_report
    from loadtests.runner import append_csv, closed_throughput, read_requests, run_locust
    from loadtests.workload import workload_options

    out = Path(args.out)
    steps_dir = out / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    for f in ("sweep.csv", "ab.csv", "throughput.csv", "report.md"):
        (out / f).unlink(missing_ok=True)
    workload = workload_options(args)
    meta = {
        "command": "lorafarm loadtest " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "conditions": _conditions(),
        "workload": workload,
        "warmup": args.warmup, "duration": args.duration, "rates": args.rates, "runs": {},
    }  # fmt: skip
    session = _Session(args)
    starts_farm = not (args.url or args.farm)
    interrupted = False

    def save_meta() -> None:
        meta["synth"] = session.synth_line
        (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")

    if not starts_farm:
        sweeps = [("sweep", None, True)]
    elif args.ab_prefix_cache:  # the same seeded replay with the replicas' prefix cache on, then off
        sweeps = [(run, args.slots[0], on) for run, on in PREFIX_AB_RUNS]
    else:
        sweeps = [(f"slots{slots}", slots, True) for slots in args.slots]
    try:
        target = None if starts_farm else session.external_target()
        for run, slots, prefix_on in sweeps:
            if starts_farm:
                target = session.start_farm(slots, prefix_cache=prefix_on)
            meta["adapters"] = len(target.models)
            step_meta = {"replicas": args.replicas if starts_farm else len(target.replica_urls) or "?",
                         "slots": slots if starts_farm else "?", "adapters": len(target.models),
                         "routing": args.routing if starts_farm else "as configured", "zipf": args.zipf,
                         "warmup": args.warmup, "duration": args.duration,
                         "prefix_cache": ("on" if prefix_on else "off") if starts_farm else "as configured",
                         **workload}  # fmt: skip
            meta["runs"][run] = {k: step_meta[k] for k in ("replicas", "slots", "routing", "adapters", "prefix_cache")}
            save_meta()
            for k, rate in enumerate(args.rates):
                name = f"{run}-{rate:g}"
                # prefix A/B: step k draws its own requests (seed + k; the same in both variants), so a step
                # never replays the previous step's prompts into a cache that still holds them whole
                step_workload = {**workload, "seed": workload["seed"] + k} if args.ab_prefix_cache else workload
                path = run_locust(target, steps_dir, name, rate=rate, duration=args.duration, warmup=args.warmup,
                                  workload=step_workload, progress=not args.quiet)  # fmt: skip
                rows = _step_rows(run, rate, path, steps_dir / f"{name}-metrics", {**step_meta, **step_workload})
                append_csv(out / "sweep.csv", rows)
                _say_step(name, rows[0])
        if args.throughput:
            if starts_farm and (session.farm is None or len(args.slots) > 1 or args.ab_prefix_cache):
                target = session.start_farm(args.slots[0])  # the first (roomiest) --slots value
            base = None
            points = [("base model", [target.base_model])] if target.base_model else []
            points += [(f"{k} adapter{'s' if k > 1 else ''}", target.models[:k]) for k in THROUGHPUT_DISTINCT
                       if k <= len(target.models)]  # fmt: skip
            for label, models in points:
                name = "throughput-" + label.split()[0]
                path = run_locust(target, steps_dir, name, mode="closed", duration=args.throughput_duration,
                                  warmup=min(args.warmup, 5.0), workload=workload, concurrency=args.concurrency,
                                  distinct=len(models), models=models, progress=not args.quiet, expected=None)  # fmt: skip
                t = closed_throughput(read_requests(path))
                base = base if base is not None else (t["output_tokens_per_s"] if label == "base model" else None)
                ratio = t["output_tokens_per_s"] / base if base else math.nan
                append_csv(out / "throughput.csv", [{"label": label, "distinct": len(models),
                                                     "concurrency": args.concurrency, **t, "ratio_vs_base": ratio}])  # fmt: skip
                print(f"lorafarm loadtest: {name}: {t['output_tokens_per_s']:.1f} output tokens/s"
                      + (f" ({ratio:.2f}x base)" if base and label != "base model" else ""), file=sys.stderr)  # fmt: skip
        if args.ab:
            # a fresh farm per variant at the tightest --slots (where routing decides the hit rate):
            # the same cold start and the same seeded replay, only the router's strategy differs
            from loadtests.report import _rows, highest_ok_rate

            ab_slots = min(args.slots)
            ab_rate = args.ab_rate or highest_ok_rate(_rows(out / "sweep.csv"), f"slots{ab_slots}") or min(args.rates)
            for routing in args.ab_routings:
                target = session.start_farm(ab_slots, routing)
                name = f"ab-{routing}"
                path = run_locust(target, steps_dir, name, rate=ab_rate, duration=args.duration, warmup=args.warmup,
                                  workload=workload, progress=not args.quiet)  # fmt: skip
                rows = _step_rows(name, ab_rate, path, steps_dir / f"{name}-metrics",
                                  {**step_meta, "slots": ab_slots, "routing": routing})  # fmt: skip
                append_csv(out / "ab.csv", [rows[0]])
                _say_step(name, rows[0])
    except KeyboardInterrupt:
        interrupted = True
        print(f"lorafarm loadtest: interrupted; partial results in {out}", file=sys.stderr)
    finally:
        session.stop()
        save_meta()
    if (out / "sweep.csv").exists():
        report = write_report(out)
        if not interrupted:
            print(report.read_text())
        print(f"lorafarm loadtest: report {report}", file=sys.stderr)
    if interrupted:
        return 130
    from loadtests.report import _rows

    errors = sum(int(r["errors"]) for r in _rows(out / "sweep.csv") if r["group"] == "all")
    return 0 if errors == 0 else 1


def register(sub) -> None:
    p = sub.add_parser("loadtest", help="the locust suite, headless: rate sweep, tiers, A/B, throughput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    g = p.add_argument_group("target (default: start a farm)")
    g.add_argument("--url", default=None, help="router URL of a running farm")
    g.add_argument("--key", default=None, help="tenant API key (with --url; or overrides farm.json's)")
    g.add_argument("--farm", default=None, help="farm.json of a running farm (`lorafarm up`)")
    g.add_argument("--replicas", type=int, default=2, help="replicas of the farm it starts (default 2)")
    g.add_argument("--adapters", type=int, default=200, help="synthetic adapters uploaded (default 200)")
    g.add_argument("--slots", type=_ints, default=[8], help="device slots per rank pool; a list gives one sweep each "
                   "(default 8)")  # fmt: skip
    g.add_argument("--ranks", type=_ints, default=[8, 16, 32], help="synthetic adapter ranks (default 8,16,32)")
    g.add_argument("--targets", choices=["mixed", "all", "attn", "mlp"], default="mixed")
    g.add_argument("--routing", choices=sorted(ROUTING_ARGS), default="affinity")
    g.add_argument("--state-dir", default="var/loadtest-farm", help="farm state, reused between runs")
    g.add_argument("--replica-arg", action="append", default=[], metavar="ARG",
                   help="extra `lorafarm replica` flag (repeatable, e.g. --replica-arg=--ram-bytes=64MiB)")
    g = p.add_argument_group("workload")
    g.add_argument("--rates", type=_floats, default=[1.0, 2.0, 4.0], help="requests/s per step (default 1,2,4)")
    g.add_argument("--duration", type=float, default=30.0, help="measured seconds per step (default 30)")
    g.add_argument("--warmup", type=float, default=10.0, help="unmeasured seconds before each step (default 10)")
    add_workload_arguments(g)
    g = p.add_argument_group("extra runs")
    g.add_argument("--ab", action="store_true", help="routing A/B: the --ab-routings variants, same seeded replay")
    g.add_argument("--ab-routings", type=_routings, default=["affinity", "random"], metavar="A,B",
                   help=f"A/B variants, each on a fresh farm ({', '.join(sorted(ROUTING_ARGS))}; "
                        "default affinity,random)")
    g.add_argument("--ab-rate", type=float, default=None, help="A/B rate (default: highest passing swept rate)")
    g.add_argument("--ab-prefix-cache", action="store_true",
                   help="prefix cache A/B: the --rates sweep on a farm with the replicas' prefix cache, then on one "
                        f"started with `lorafarm replica {NO_PREFIX_CACHE}` (same seeded replay; needs "
                        "--system-prompt-share > 0)")  # fmt: skip
    g.add_argument("--throughput", action="store_true", help="closed loop: base model vs 1, 8, 32 adapters")
    g.add_argument("--concurrency", type=int, default=32, help="throughput: requests in flight (default 32)")
    g.add_argument("--throughput-duration", type=float, default=20.0, help="measured seconds per point (20)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="var/loadtest", help="results folder (default var/loadtest)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--report-from", default=None, metavar="DIR", help="only re-render the report of a results folder")
    g.add_argument("--to", default=None, metavar="DOCS", help="with --report-from: publish to DOCS/loadtests.md")
    p.set_defaults(func=_loadtest)


# -- lorafarm adapters synth ---------------------------------------------------------------


def _synth(args: argparse.Namespace) -> int:
    import asyncio

    from loadtests.synth import synth_upload
    from lorafarm.registry_client import RegistryError
    from lorafarm.settings import load_farm_json, registry_connection

    if args.count < 1:
        raise CliError(f"--count {args.count}: must be at least 1")
    if any(r < 1 for r in args.ranks):
        raise CliError(f"--ranks {args.ranks}: ranks must be at least 1")
    if args.concurrency < 1:
        raise CliError(f"--concurrency {args.concurrency}: must be at least 1")
    url, token = registry_connection(args.registry_url, args.admin_token, args.farm)
    if not token:
        raise CliError("no admin token: pass --admin-token, set LORAFARM_ADMIN_TOKEN, or run `lorafarm up` (farm.json)")
    base = args.base
    if base is None:
        bases = load_farm_json(args.farm).get("base_models", {})
        if len(bases) != 1:
            raise CliError("--base DIR is required (farm.json names " + (f"{len(bases)} base models)" if bases else "none)"))
        base = next(iter(bases.values()))
    if not Path(base, "config.json").is_file():
        raise CliError(f"--base {base}: no config.json there")
    try:
        res = asyncio.run(synth_upload(url, token, Path(base), args.tenant, args.count, args.ranks, args.targets,
                                       aliases=args.aliases, seed=args.seed, concurrency=args.concurrency))  # fmt: skip
    except RegistryError as e:
        raise CliError(e.message if e.status == 0 else f"{e.message} (HTTP {e.status})") from None
    if res.api_key:
        print(f"tenant {args.tenant} created; API key (shown only now): {res.api_key}", file=sys.stderr)
    print(res.summary(args.tenant))
    return 0


def add_synth_parser(adapters_group, connection_flags) -> None:
    """`lorafarm adapters synth`, registered into registry/cli.py's `adapters` group."""
    p = adapters_group.add_parser("synth", help="random PEFT adapters on the base, uploaded through the registry")
    p.add_argument("--count", type=int, required=True, help="adapters to make")
    p.add_argument("--ranks", type=_ints, default=[8, 16, 32], help="ranks, cycled (default 8,16,32)")
    p.add_argument("--targets", choices=["mixed", "all", "attn", "mlp"], default="mixed",
                   help="target modules: mixed cycles all/attention/mlp (default mixed)")
    p.add_argument("--tenant", required=True, help="owning tenant (created when missing)")
    p.add_argument("--aliases", action="store_true", help="also set <tenant>/synth-NNNNN:prod per adapter")
    p.add_argument("--base", default=None, help="base model folder (default: farm.json's only base model)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same bytes, same adapter ids (default 0)")
    p.add_argument("--concurrency", type=int, default=8, help="uploads in flight (default 8)")
    connection_flags(p)
    p.set_defaults(func=_synth)
