"""Ours beside the peers on one model and N adapters, in interleaved rounds; raw CSVs only.

    python -m benchmarks.peers.run --model DIR --adapters 32 --rounds 3 \
        --peers ours,vllm,llamacpp,transformers --out var/peers/results

Installs missing peers (install.py), writes the adapters and their GGUF files (adapters.py,
convert.py), starts every server (servers.py) and keeps them up; checks greedy text on a few
prompts for the base and two adapters across servers (also the warm-up); then each round runs every
server once, in a shuffled order, through every workload (workloads.py); the servers not being
measured are paused (SIGSTOP, all their processes) so that none takes CPU from the one measured. Written to --out, batch by
batch (a cut run keeps what it measured): meta.json (command, versions, threads, exact server
commands), requests.csv, batches.csv, rounds.csv (the machine's load average per round),
agreement.csv. docs/peers.md is rendered separately: `python -m benchmarks.peers.report`.
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
from benchmarks.peers.adapters import adapter_dirs, default_dir
from benchmarks.peers.install import install, parse_peers
from benchmarks.peers.workloads import MAX_TOKENS, WORKLOADS, Workload, run_batch
from lorafarm.errors import CliError

AGREE_PROMPTS = 3
REQUEST_FIELDS = ["round", "slot", "peer", "workload", "index", "adapter", "ok", "error", "ttft_s", "total_s",
                  "completion_tokens", "prompt_tokens"]
BATCH_FIELDS = ["round", "slot", "peer", "workload", "requests", "concurrency", "failed", "wall_s",
                "completion_tokens", "tokens_per_s", "load1_before", "load1_after"]
ROUND_FIELDS = ["round", "order", "started_unix", "wall_s", "load1", "load5", "load15", "load1_end"]
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
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="intra-op threads of every server (default: all cores)")
    p.add_argument("--agree-prompts", type=int, default=AGREE_PROMPTS, help="prompts of the greedy agreement check")
    p.add_argument("--seed", type=int, default=0, help="round order and prompts")
    p.add_argument("--root", type=Path, default=PEERS_ROOT, help="installs, adapters, GGUF files, logs (default var/peers)")
    p.add_argument("--out", type=Path, default=PEERS_ROOT / "results")
    p.add_argument("--ours-replica-flags", default=None,
                   help="default: '--slots N --max-batch 32 --dtype float32' (every adapter on a device slot)")
    p.add_argument("--ours-router-flags", default="--first-byte-timeout 600 --read-timeout 600")
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
    if args.rounds < 1 or (args.requests is not None and args.requests < 1):
        raise CliError("--rounds and --requests must be at least 1")
    args.peer_list = parse_peers(args.peers)
    args.workload_list = [w.scaled(args.requests) for w in parse_workloads(args.workloads)]
    if args.adapters == 0 and any(w.adapters for w in args.workload_list):
        raise CliError("--adapters 0: workloads " + ",".join(w.name for w in args.workload_list if w.adapters)
                       + " need adapters; pass --adapters N or --workloads W1")
    return args


def _say(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def build_servers(args, adapters: list[Path]) -> list[servers.Server]:
    out = []
    logs = args.out / "logs"
    for peer in args.peer_list:
        got = install(peer, args.root)
        if peer == "ours":
            flags = args.ours_replica_flags or f"--slots {max(1, len(adapters))} --max-batch 32 --dtype float32"
            out.append(servers.ours(got, args.model, adapters, args.root / "ours-state" / args.model.resolve().name, args.threads, flags,
                                    args.ours_router_flags))
        elif peer == "vllm":
            out.append(servers.vllm(got, args.model, adapters, logs, args.threads))
        elif peer == "llamacpp":
            from benchmarks.peers.convert import convert_adapters, convert_base, gguf_dir
            from benchmarks.peers.install import converter_python

            source, python = Path(got.extra["source"]), converter_python(args.root)
            gdir = gguf_dir(args.root, args.model)
            _say("converting the model and adapters to GGUF (once)")
            base = convert_base(args.model, gdir, source, python)
            loras = convert_adapters(args.model, adapters, gdir, source, python, progress=not args.quiet)
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


def measure(args, running: list[servers.Server], adapters: list[str]) -> None:
    from tqdm import tqdm

    rng = random.Random(args.seed)
    files = {name: _Csv(args.out / f"{name}.csv", fields) for name, fields in
             [("requests", REQUEST_FIELDS), ("batches", BATCH_FIELDS), ("rounds", ROUND_FIELDS)]}
    plan = [(s, w) for s in running for w in args.workload_list if s.supports_adapters() or not w.adapters]
    bar = tqdm(total=args.rounds * len(plan), desc="batches", unit="batch", disable=args.quiet)
    try:
        for rnd in range(1, args.rounds + 1):
            order = running[:]
            rng.shuffle(order)
            load, t_round = os.getloadavg(), time.time()
            prompts = [p for p in _prompts(args.seed * 1000 + rnd, 64)]
            for slot, server in enumerate(order):
                _alone(server, running, args.keep_idle_running)
                for w in [w for s, w in plan if s is server]:
                    bar.set_description(f"round {rnd}/{args.rounds} {server.peer} {w.name}")
                    before = os.getloadavg()[0]
                    wall, results = asyncio.run(run_batch(server, w, prompts, adapters, args.max_tokens))
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
            files["rounds"].add(round=rnd, order=" ".join(s.peer for s in order), started_unix=round(t_round, 1),
                                wall_s=round(time.time() - t_round, 1), load1=load[0], load5=load[1], load15=load[2],
                                load1_end=os.getloadavg()[0])
    finally:
        bar.close()
        for f in files.values():
            f.close()


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
        adapters = adapter_dirs(args.model, default_dir(args.root, args.model), args.adapters, progress=not args.quiet)
        todo = build_servers(args, adapters)
    except CliError as e:
        print(f"peers run: {e}", file=sys.stderr)
        return 2
    running: list[servers.Server] = []
    meta = {"command": shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.peers.run", *(argv or sys.argv[1:])]),
            "started_unix": time.time(), "model": str(args.model.resolve()), "adapters": [a.name for a in adapters],
            "rounds": args.rounds, "threads": args.threads, "max_tokens": args.max_tokens, "seed": args.seed,
            "workloads": [asdict(w) for w in args.workload_list], "cpus": os.cpu_count(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "load_at_start": os.getloadavg(),
            "idle_servers": "running" if args.keep_idle_running else "paused (SIGSTOP) while another is measured"}
    try:
        for s in todo:  # all at once: the slow starters (vLLM, ours) overlap
            _say(f"starting {s.peer}: {shlex.join(s.command[:6])} ... (log {s.log})")
            running.append(s.launch())
        for s in running:
            s.wait_ready(args.startup_timeout)
            _say(f"{s.peer} ready after {s.started_s:.0f} s")
        meta["servers"] = [s.describe() for s in running]
        meta["skipped"] = [{"peer": s.peer, "workload": w.name, "why": "no per-request LoRA"}
                           for s in running for w in args.workload_list if w.adapters and not s.supports_adapters()]
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        names = [a.name for a in adapters]
        _say("greedy agreement check (also the warm-up)")
        sink = _Csv(args.out / "agreement.csv", AGREE_FIELDS)
        try:
            agreement(running, names, _prompts(args.seed, args.agree_prompts), args.max_tokens, sink)
        finally:
            sink.close()
        measure(args, running, names)
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
        for s in running:  # all at once, then each waited for
            s.ask_stop()
        for s in reversed(running):
            s.stop()
    _say(f"results in {args.out}; render with: python -m benchmarks.peers.report --from {args.out} --to docs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
