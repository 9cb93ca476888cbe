"""Ours beside the peers on one model and N adapters, in interleaved rounds; raw CSVs only.

    python -m benchmarks.peers.run --model DIR --adapters 32 --rounds 3 \
        --peers ours,vllm,llamacpp,transformers --out var/peers/results

Installs missing peers (install.py), writes the adapters and their GGUF files (adapters.py,
convert.py), starts every server (servers.py) and keeps them up; checks greedy text on a few
prompts for the base and two adapters across servers (also the warm-up); then each round runs every
server once, in a shuffled order, through every workload (workloads.py); the servers not being
measured are paused (SIGSTOP, all their processes) so that none takes CPU from the one measured.

W6 (the Zipf mix) runs in a second phase, once W1-W5's servers are stopped, so that W1-W5 run as
before: the servers with per-request LoRA start again with W6's own set of --zipf-adapters adapters
(adapters.zipf_dirs) and ZIPF_SLOTS device slots, are warmed up (warm_up), then measured in rounds
like the others; transformers serve sits it out.

Written to --out, batch by batch (a cut run keeps what it measured): meta.json (command, versions,
threads, each phase's exact server commands, W6's adapter set), requests.csv, batches.csv,
rounds.csv (the machine's load average per round and phase), agreement.csv (W1-W5's servers).
docs/peers.md is rendered separately: `python -m benchmarks.peers.report`.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import random
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.peers import PEERS_ROOT, servers
from benchmarks.peers.adapters import ZIPF_RANK, adapter_dirs, default_dir, weights_bytes, zipf_dirs
from benchmarks.peers.install import install, parse_peers
from benchmarks.peers.workloads import MAX_TOKENS, WORKLOADS, ZIPF_EXPONENT, Workload, run_batch, zipf_sequence
from lorafarm.errors import CliError

AGREE_PROMPTS = 3
ZIPF_SLOTS = 32  # W6's device adapter slots (ours --slots, vLLM --max-loras): W2's 32, above W6's 8 in flight
LORA_PEERS = ("ours", "vllm", "llamacpp")  # those with per-request LoRA: W6's servers
REQUEST_FIELDS = ["round", "slot", "peer", "workload", "index", "adapter", "ok", "error", "ttft_s", "total_s",
                  "completion_tokens", "prompt_tokens"]
BATCH_FIELDS = ["round", "slot", "peer", "workload", "requests", "concurrency", "failed", "wall_s",
                "completion_tokens", "tokens_per_s", "load1_before", "load1_after"]
ROUND_FIELDS = ["round", "workloads", "order", "started_unix", "wall_s", "load1", "load5", "load15", "load1_end"]
AGREE_FIELDS = ["prompt_index", "model", "peer", "reference", "same_as_reference", "ok", "text"]


class _Csv:
    """One CSV file written row by row (flushed: a cut run keeps its rows)."""

    def __init__(self, path: Path, fields: list[str]):
        self.f = open(path, "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=fields)
        self.w.writeheader()

    def add(self, **row) -> None:
        self.w.writerow(row)
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def parse_workloads(value: str) -> list[Workload]:
    names = [n.strip().upper() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise CliError(f"--workloads {value!r}: unknown workload {bad[0] if bad else '(none)'}; "
                       f"choose from {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="Hugging Face model folder (e.g. lorafarm realmodel --out)")
    p.add_argument("--adapters", type=int, default=32, help="random rank-16 adapters on all 7 projections (default 32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", default="ours,vllm,llamacpp,transformers")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--requests", type=int, default=None, help="requests per workload (default: each workload's own)")
    p.add_argument("--zipf-adapters", type=int, default=WORKLOADS["W6"].zipf_pool,
                   help="W6: the adapters its Zipf mix draws from (rank 8 on q/k/v/o_proj; default 1000)")
    p.add_argument("--zipf-requests", type=int, default=None,
                   help=f"W6's requests (default: --requests, else {WORKLOADS['W6'].requests})")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="intra-op threads of every server (default: all cores)")
    p.add_argument("--agree-prompts", type=int, default=AGREE_PROMPTS, help="prompts of the greedy agreement check")
    p.add_argument("--seed", type=int, default=0, help="round order and prompts")
    p.add_argument("--root", type=Path, default=PEERS_ROOT, help="installs, adapters, GGUF files, logs (default var/peers)")
    p.add_argument("--out", type=Path, default=PEERS_ROOT / "results")
    p.add_argument("--ours-replica-flags", default=None,
                   help="default: '--slots N --max-batch 32 --dtype float32' (every adapter on a device slot)")
    p.add_argument("--ours-router-flags", default="--first-byte-timeout 600 --read-timeout 600")
    p.add_argument("--ours-parallel-products", default="", choices=["", "all"],
                   help="LORAFARM_PARALLEL_PRODUCTS for ours' replica (default: unset, the replica's own default; "
                        "'all' was this bench's setting before issue 39)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--keep-idle-running", action="store_true",
                   help="do not pause (SIGSTOP) the servers not being measured")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise CliError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
    for name in ("adapters", "threads", "max_tokens", "agree_prompts"):
        if getattr(args, name) < (0 if name in ("adapters", "agree_prompts") else 1):
            raise CliError(f"--{name.replace('_', '-')} {getattr(args, name)}: out of range")
    requests = [n for n in (args.requests, args.zipf_requests) if n is not None]
    if min([args.rounds, args.zipf_adapters, *requests]) < 1:
        raise CliError("--rounds, --requests, --zipf-adapters and --zipf-requests must be at least 1")
    args.peer_list = parse_peers(args.peers)
    args.workload_list = [w.pooled(args.zipf_adapters).scaled(args.zipf_requests or args.requests) if w.zipf_pool
                          else w.scaled(args.requests) for w in parse_workloads(args.workloads)]
    main = [w for w in args.workload_list if w.adapters and not w.zipf_pool]
    if args.adapters == 0 and main:
        raise CliError("--adapters 0: workloads " + ",".join(w.name for w in main)
                       + " need adapters; pass --adapters N or --workloads W1")
    return args


def _say(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def build_servers(args, adapters: list[Path], zipf: bool = False) -> list[servers.Server]:
    """One phase's servers: W1-W5's on the main set, or (zipf) W6's on its own set, peers with LoRA only."""
    out = []
    logs = args.out / "logs" / "w6" if zipf else args.out / "logs"
    for peer in [p for p in args.peer_list if p in LORA_PEERS or not zipf]:
        got = install(peer, args.root)
        if peer == "ours":
            slots = ZIPF_SLOTS if zipf else max(1, len(adapters))
            flags = args.ours_replica_flags or f"--slots {slots} --max-batch 32 --dtype float32"
            state = args.root / "ours-state" / (adapters[0].parent.name if zipf else args.model.resolve().name)
            out.append(servers.ours(got, args.model, adapters, state, args.threads, flags, args.ours_router_flags,
                                    upload=zipf, progress=not args.quiet,
                                    parallel_products=args.ours_parallel_products))
        elif peer == "vllm":
            # W6: every adapter may stay in its CPU cache, as all 1,000 fit ours' RAM tier (4 GiB by default)
            sizes = dict(rank=ZIPF_RANK, max_loras=ZIPF_SLOTS, cpu_loras=len(adapters)) if zipf else {}
            out.append(servers.vllm(got, args.model, adapters, logs, args.threads, **sizes))
        elif peer == "llamacpp":
            from benchmarks.peers.convert import convert_adapters, convert_base, gguf_dir, zipf_gguf_dir
            from benchmarks.peers.install import converter_python

            source, python = Path(got.extra["source"]), converter_python(args.root)
            gdir = gguf_dir(args.root, args.model)
            _say("converting the model and adapters to GGUF (once)")
            base = convert_base(args.model, gdir, source, python)
            loras = convert_adapters(args.model, adapters, zipf_gguf_dir(args.root, args.model) if zipf else gdir,
                                     source, python, progress=not args.quiet)
            out.append(servers.llamacpp(got, base, loras, logs, args.threads))
        else:
            out.append(servers.transformers(got, args.model, logs, args.threads))
    return out


def agreement(running: list[servers.Server], adapters: list[str], prompts: list[str], max_tokens: int, sink: _Csv) -> None:
    """Greedy text of the same prompts on the base and two adapters, every server that serves them."""
    for model in [None, *adapters[:2]]:
        targets = [s for s in running if model is None or s.supports_adapters()]
        wl = Workload("agree", "agreement", model is not None, 1, len(prompts))
        texts = {}
        for s in targets:
            _alone(s, running)
            texts[s.peer] = asyncio.run(run_batch(s, wl, prompts, [model] if model else [], max_tokens))[1]
        ref = targets[0].peer
        for i in range(len(prompts)):
            for s in targets:
                r = texts[s.peer][i]
                sink.add(prompt_index=i, model=model or "base", peer=s.peer, reference=ref, ok=r.ok,
                         same_as_reference=r.ok and texts[ref][i].ok and r.text == texts[ref][i].text, text=r.text)


def warm_up(running: list[servers.Server], adapter: str, prompt: str, max_tokens: int) -> None:
    """W6's servers, just started, had no agreement check: one base and one adapter request each, not
    recorded, take first-request costs out of round 1. The adapter is the Zipf law's least popular,
    so the adapters the mix favours are as each server holds them after its start-up."""
    for s in running:
        _alone(s, running)
        for on in (None, adapter):
            asyncio.run(run_batch(s, Workload("warm-up", "warm-up", on is not None, 1, 1), [prompt], [on], max_tokens))


def measure(args, running: list[servers.Server], workloads: list[Workload], adapters: list[str],
            files: dict[str, _Csv]) -> None:
    """Rounds of every server through `workloads`; W6's adapter sequence drawn once per round."""
    from tqdm import tqdm

    rng = random.Random(args.seed)
    plan = [(s, w) for s in running for w in workloads if s.supports_adapters() or not w.adapters]
    bar = tqdm(total=args.rounds * len(plan), desc="batches", unit="batch", disable=args.quiet)
    try:
        for rnd in range(1, args.rounds + 1):
            order = running[:]
            rng.shuffle(order)
            load, t_round = os.getloadavg(), time.time()
            prompts = [p for p in _prompts(args.seed * 1000 + rnd, 64)]
            sequence = {w.name: zipf_sequence(adapters, w.requests, args.seed * 1000 + rnd) if w.zipf_pool else adapters
                        for w in workloads}
            for slot, server in enumerate(order):
                _alone(server, running, args.keep_idle_running)
                for w in [w for s, w in plan if s is server]:
                    bar.set_description(f"round {rnd}/{args.rounds} {server.peer} {w.name}")
                    before = os.getloadavg()[0]
                    wall, results = asyncio.run(run_batch(server, w, prompts, sequence[w.name], args.max_tokens))
                    tokens = sum(r.completion_tokens or 0 for r in results)
                    for r in results:
                        files["requests"].add(round=rnd, slot=slot, peer=server.peer, workload=w.name,
                                              **{k: v for k, v in asdict(r).items() if k != "text"})
                    files["batches"].add(round=rnd, slot=slot, peer=server.peer, workload=w.name, requests=w.requests,
                                         concurrency=w.concurrency, failed=sum(not r.ok for r in results),
                                         wall_s=round(wall, 4), completion_tokens=tokens,
                                         tokens_per_s=round(tokens / wall, 3) if wall else None,
                                         load1_before=before, load1_after=os.getloadavg()[0])
                    bar.update(1)
            files["rounds"].add(round=rnd, workloads=" ".join(w.name for w in workloads),
                                order=" ".join(s.peer for s in order), started_unix=round(t_round, 1),
                                wall_s=round(time.time() - t_round, 1), load1=load[0], load5=load[1], load15=load[2],
                                load1_end=os.getloadavg()[0])
    finally:
        bar.close()


def run_phase(args, workloads: list[Workload], adapters: list[Path], zipf: bool, meta: dict,
              files: dict[str, _Csv]) -> None:
    """Start one phase's servers, check or warm them, measure `workloads` in rounds, stop them."""
    todo = build_servers(args, adapters, zipf)
    if zipf and "llamacpp" in args.peer_list:  # what llama-server holds in memory: every adapter, from the start
        from benchmarks.peers.convert import lora_file, zipf_gguf_dir

        gdir = zipf_gguf_dir(args.root, args.model)
        meta["zipf"]["gguf_bytes"] = sum(lora_file(gdir, a.name).stat().st_size for a in adapters)
    running: list[servers.Server] = []
    try:
        for s in todo:  # all at once: the slow starters (vLLM, ours) overlap
            _say(f"starting {s.peer}: {shlex.join(s.command[:6])} ... (log {s.log})")
            running.append(s.launch())
        for s in running:
            s.wait_ready(args.startup_timeout)
            _say(f"{s.peer} ready after {s.started_s:.0f} s")
        names = [w.name for w in workloads]
        meta["servers"] += [{**s.describe(), "workloads": names} for s in running]
        served = {s.peer for s in running if s.supports_adapters()}
        meta["skipped"] += [{"peer": p, "workload": w.name, "why": "no per-request LoRA"}
                            for p in args.peer_list for w in workloads if w.adapters and p not in served]
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        adapter_names = [a.name for a in adapters]
        if zipf:
            _say("W6 warm-up: one base and one adapter request per server")
            warm_up(running, adapter_names[-1], _prompts(args.seed, 1)[0], args.max_tokens)
        else:
            _say("greedy agreement check (also the warm-up)")
            sink = _Csv(args.out / "agreement.csv", AGREE_FIELDS)
            try:
                agreement(running, adapter_names, _prompts(args.seed, args.agree_prompts), args.max_tokens, sink)
            finally:
                sink.close()
        measure(args, running, workloads, adapter_names, files)
    finally:
        for s in running:  # all at once, then each waited for
            s.ask_stop()
        for s in reversed(running):
            s.stop()


def _alone(server: servers.Server, running: list[servers.Server], keep_idle_running: bool = False) -> None:
    """Only `server` runs: the others are paused (SIGSTOP), it is resumed and answering."""
    if keep_idle_running:
        return
    for s in running:
        if s is not server:
            s.pause()
    server.resume()


def _prompts(seed: int, count: int) -> list[str]:
    from lorafarm.dev.adapters import random_prompts

    return random_prompts(seed=seed, count=count)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: stop the servers, keep what was measured


def main(argv: list[str] | None = None) -> int:
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    try:
        args = _args(argv)
        args.out.mkdir(parents=True, exist_ok=True)
        main_workloads = [w for w in args.workload_list if not w.zipf_pool]
        zipf_workloads = [w for w in args.workload_list if w.zipf_pool]
        adapters = adapter_dirs(args.model, default_dir(args.root, args.model), args.adapters,
                                progress=not args.quiet) if main_workloads else []
        pool = zipf_dirs(args.model, args.root, args.zipf_adapters, progress=not args.quiet) if zipf_workloads else []
    except CliError as e:
        print(f"peers run: {e}", file=sys.stderr)
        return 2
    meta = {"command": shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.peers.run", *(argv or sys.argv[1:])]),
            "started_unix": time.time(), "model": str(args.model.resolve()), "adapters": [a.name for a in adapters],
            "rounds": args.rounds, "threads": args.threads, "max_tokens": args.max_tokens, "seed": args.seed,
            "workloads": [asdict(w) for w in args.workload_list], "cpus": os.cpu_count(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "load_at_start": os.getloadavg(),
            "idle_servers": "running" if args.keep_idle_running else "paused (SIGSTOP) while another is measured",
            "servers": [], "skipped": []}
    if pool:
        config = json.loads((pool[0] / "adapter_config.json").read_text())
        meta["zipf"] = {"adapters": len(pool), "rank": config["r"], "target_modules": config["target_modules"],
                        "exponent": ZIPF_EXPONENT, "device_slots": ZIPF_SLOTS, "adapter_bytes": weights_bytes(pool[:1]),
                        "total_bytes": weights_bytes(pool)}
    files = {name: _Csv(args.out / f"{name}.csv", fields) for name, fields in
             [("requests", REQUEST_FIELDS), ("batches", BATCH_FIELDS), ("rounds", ROUND_FIELDS)]}
    try:
        for workloads, phase_adapters, zipf in [(main_workloads, adapters, False), (zipf_workloads, pool, True)]:
            if workloads:
                run_phase(args, workloads, phase_adapters, zipf, meta, files)
        meta["finished_unix"] = time.time()
        meta["load_at_end"] = os.getloadavg()
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    except CliError as e:
        print(f"peers run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("peers run: interrupted; what was measured is in " + str(args.out), file=sys.stderr)
        return 130
    finally:
        for f in files.values():
            f.close()
    _say(f"results in {args.out}; render with: python -m benchmarks.peers.report --from {args.out} --to docs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
