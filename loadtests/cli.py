"""`lorafarm loadtest`: start a farm, replay a skewed workload through the router, report TTFT and
TPOT by tier (and, with --ab, affinity vs random routing), as markdown plus a PNG in docs/."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path


def _loadtest(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from loadtests.report import markdown, plot_ttft
    from loadtests.runner import replay
    from loadtests.workload import WorkloadSpec, generate
    from lorafarm.farm import Farm, FarmPorts, wait_router_ready

    farm = Farm(
        Path(args.state_dir),
        replicas=args.replicas,
        ports=FarmPorts.free(args.replicas),
        demo_adapters=args.adapters,
        replica_args=["--slots", str(args.slots)],
    )
    command = "lorafarm loadtest " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    spec = WorkloadSpec(rate=args.rate, duration=args.duration, seed=args.seed)
    runs = {}
    try:
        info = farm.up()
        tenant = info["tenants"][0]
        models = sorted(tenant["aliases"])
        items = generate(models, spec)
        # A: affinity (warm first, then owners; least tokens in flight within a class, the default);
        # B: random over every healthy replica, blind to where adapters are (--no-affinity).
        variants = {"affinity": [], "random": ["--strategy", "random", "--no-affinity"]}
        if not args.ab:
            variants.pop("random")
        for name, router_args in variants.items():
            if router_args:
                farm.restart_router(router_args)
                wait_router_ready(info)
            # warm-up pass (not measured): adapters reach their replicas' slots, as in steady state
            warm = generate(models, WorkloadSpec(rate=args.rate, duration=min(10.0, args.duration), seed=args.seed + 1))
            asyncio.run(replay(info["router_url"] + "/v1", tenant["api_key"], warm))
            with tqdm(total=len(items), desc=f"loadtest ({name})", unit="req") as bar:
                runs[name] = asyncio.run(replay(info["router_url"] + "/v1", tenant["api_key"], items, bar))
    finally:
        farm.stop()

    out = Path(args.out)
    parts = [
        "# Load test",
        "",
        f"Farm: {args.replicas} replicas of the tiny dev model on this machine's CPU, {args.slots} device slots "
        f"per rank pool (ranks 8/16/32/64) on each, {args.adapters} "
        f"adapters, Zipf(s={spec.zipf_s}) adapter mix, Poisson arrivals at {spec.rate} req/s for "
        f"{spec.duration:.0f} s, log-normal prompt and output lengths. Streamed through the router.",
        "",
    ]
    for strategy, summary in runs.items():
        parts.append(markdown(summary, f"routing: {strategy}", command))
        hit = sum(r.tier == "gpu" for r in summary.results if r.ok) / max(1, len(summary.results))
        parts.append(f"Device-slot hit rate (x-adapter-tier = gpu): {100 * hit:.1f}%\n")
    png = out.with_suffix(".png")
    plot_ttft(runs, png)
    parts.append(f"![TTFT CDF]({png.name})\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))
    print(out.read_text())
    return 0 if all(s.errors == 0 for s in runs.values()) else 1


def register(sub) -> None:
    p = sub.add_parser("loadtest", help="replay a skewed workload through a fresh farm; report TTFT/TPOT by tier")
    p.add_argument("--state-dir", default="var/loadtest", help="farm state (reused between runs)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--adapters", type=int, default=16, help="distinct adapters in the mix")
    p.add_argument("--slots", type=int, default=2, help="device slots per rank pool on each replica (default 2:"
                   " fewer slots than adapters, so routing decides the hit rate)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ab", action="store_true", help="also replay with random routing, for the A/B")
    p.add_argument("--out", default="docs/loadtest.md", help="markdown report (a PNG is written beside it)")
    p.set_defaults(func=_loadtest)
