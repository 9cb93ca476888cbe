"""docs/peers.md and its plots from the raw CSVs of a `benchmarks.peers.run`; only when asked:

    python -m benchmarks.peers.report --from var/peers/results --to docs [--notes FILE.md]

Tokens/s per workload and server is the median over rounds of each batch's completion tokens / wall
time; TTFT p50/p95 over every request of every round; single-stream TPOT (W4) the median over
requests of (total - TTFT) / (tokens - 1). W6's servers (a second phase, started with its own
adapter set) share their peers' columns. --notes adds a hand-written section (what did not run, why).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

from handler.engine.speculate import SPECULATE_TOKENS
from lorafarm.errors import CliError

NAMES = {"ours": "ours", "vllm": "vLLM", "llamacpp": "llama.cpp", "transformers": "transformers serve"}
# issue 22's acceptance: ours / peer tokens/s at least this (None: not a target) ...
TOKEN_TARGETS = {("W1", "vllm"): 1.0, ("W1", "llamacpp"): 1.0, ("W2", "vllm"): 1.3, ("W2", "llamacpp"): 2.0,
                 ("W5", "vllm"): 1.3, ("W5", "llamacpp"): 2.0}
TTFT_P95_TARGET = 0.7  # ... and ours' TTFT p95 at most this times each peer's on W1, W2, W5


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _f(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def load(results: Path) -> dict:
    meta_file = results / "meta.json"
    if not meta_file.is_file():
        raise CliError(f"--from {results}: no meta.json (not the --out of a benchmarks.peers.run)")
    batches = _read(results / "batches.csv")
    if not batches:
        raise CliError(f"--from {results}: batches.csv is missing or empty (the run measured nothing)")
    return {"meta": json.loads(meta_file.read_text()), "batches": batches, "requests": _read(results / "requests.csv"),
            "rounds": _read(results / "rounds.csv"), "agreement": _read(results / "agreement.csv")}


def peers_of(meta: dict) -> list[str]:
    """Each peer once, in the order first started (W6's phase starts most of them again), then those
    only skipped (a W6-only run does not start transformers serve)."""
    return list(dict.fromkeys([s["peer"] for s in meta["servers"]] + [k["peer"] for k in meta.get("skipped", [])]))


def workloads_of(server_or_round: dict, meta: dict) -> list[str]:
    """The workloads a server (or a round) ran; results from before W6 recorded none: all of them."""
    named = server_or_round.get("workloads")
    return (named.split() if isinstance(named, str) else named) or [w["name"] for w in meta["workloads"]]


def summarise(data: dict) -> dict:
    """(workload, peer) -> tokens/s median, rounds, failed, TTFT p50/p95 (s), TPOT median (s)."""
    out: dict[tuple[str, str], dict] = {}
    for b in data["batches"]:
        s = out.setdefault((b["workload"], b["peer"]), {"tps": [], "failed": 0, "requests": 0})
        if _f(b["tokens_per_s"]) is not None:
            s["tps"].append(_f(b["tokens_per_s"]))
        s["failed"] += int(b["failed"])
        s["requests"] += int(b["requests"])
    for key, s in out.items():
        reqs = [r for r in data["requests"] if (r["workload"], r["peer"]) == key and r["ok"] == "True"]
        ttft = [_f(r["ttft_s"]) for r in reqs if _f(r["ttft_s"]) is not None]
        tpot = [(_f(r["total_s"]) - _f(r["ttft_s"])) / (int(r["completion_tokens"]) - 1) for r in reqs
                if _f(r["ttft_s"]) is not None and int(r["completion_tokens"] or 0) > 1]
        s.update(tokens_per_s=statistics.median(s["tps"]) if s["tps"] else None, rounds=len(s["tps"]),
                 ttft_p50=pct(ttft, 0.5), ttft_p95=pct(ttft, 0.95), tpot=statistics.median(tpot) if tpot else None)
    return out


def _num(x, digits=1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:,.0f}"


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def table(data: dict, summary: dict) -> list[str]:
    peers = peers_of(data["meta"])
    others = [p for p in peers if p != "ours"]
    head = ["workload", *[f"{NAMES.get(p, p)} tok/s" for p in peers],
            *([f"ours/{NAMES.get(p, p)}" for p in others] if "ours" in peers else []),
            f"TTFT p50 {' / '.join(NAMES.get(p, p) for p in peers)} (ms)",
            f"TTFT p95 {' / '.join(NAMES.get(p, p) for p in peers)} (ms)", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    why = {(k["workload"], k["peer"]): k["why"] for k in data["meta"].get("skipped", [])}
    for w in data["meta"]["workloads"]:
        cells = {p: summary.get((w["name"], p)) for p in peers}
        if not any(cells.values()) and not any(n == w["name"] for n, _ in why):
            continue
        row = [f"{w['name']} {w['title']} ({w['requests']} requests)"]
        row += [_num(c["tokens_per_s"]) if c else f"n/a: {why[(w['name'], p)]}" if (w["name"], p) in why else "not run"
                for p, c in cells.items()]
        if "ours" in peers:
            ours = cells["ours"]
            row += [f"{r:.2f}x" if (r := _ratio(ours and ours["tokens_per_s"], c and c["tokens_per_s"])) else "-"
                    for p, c in cells.items() if p != "ours"]
        row.append(" / ".join(_ms(c["ttft_p50"]) if c else "-" for c in cells.values()))
        row.append(" / ".join(_ms(c["ttft_p95"]) if c else "-" for c in cells.values()))
        row.append(str(sum(c["failed"] for c in cells.values() if c)))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def targets(data: dict, summary: dict) -> list[str]:
    """Issue 22's acceptance ratios, each met or not (only where both sides ran)."""
    rows = []
    for (w, peer), goal in TOKEN_TARGETS.items():
        r = _ratio(*(summary.get((w, p), {}).get("tokens_per_s") for p in ("ours", peer)))
        if r is not None:
            rows.append(f"| {w} tokens/s ours/{NAMES[peer]} | >= {goal:.1f}x | {r:.2f}x | {'met' if r >= goal else 'NOT met'} |")
    for w in ("W1", "W2", "W5"):
        for peer in ("vllm", "llamacpp"):
            r = _ratio(*(summary.get((w, p), {}).get("ttft_p95") for p in ("ours", peer)))
            if r is not None:
                rows.append(f"| {w} TTFT p95 ours/{NAMES[peer]} | <= {TTFT_P95_TARGET}x | {r:.2f}x | "
                            f"{'met' if r <= TTFT_P95_TARGET else 'NOT met'} |")
    a, b = (summary.get(("W4", p), {}).get("tpot") for p in ("ours", "llamacpp"))
    if a and b:
        rows.append(f"| W4 single-stream TPOT ours vs llama.cpp | <= | {a * 1000:.1f} vs {b * 1000:.1f} ms | "
                    f"{'met' if a <= b else 'NOT met'} |")
    return ["| target | goal | measured | |", "| --- | --- | --- | --- |", *rows] if rows else []


def plots(data: dict, summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    peers = peers_of(data["meta"])
    wls = [w["name"] for w in data["meta"]["workloads"] if any(summary.get((w["name"], p)) for p in peers)]
    made = []
    for name, metrics, ylabel in [("throughput.png", [("tokens_per_s", "")], "completion tokens/s (median over rounds)"),
                                  ("ttft.png", [("ttft_p50", " p50"), ("ttft_p95", " p95")], "TTFT (s)")]:
        fig, ax = plt.subplots(figsize=(8, 4))
        bars = [(p, m, lab) for p in peers for m, lab in metrics]
        width = 0.8 / len(bars)
        for i, (p, m, lab) in enumerate(bars):
            ys = [(summary.get((w, p)) or {}).get(m) or 0 for w in wls]
            ax.bar([x + i * width for x in range(len(wls))], ys, width, label=NAMES.get(p, p) + lab)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(wls))], wls)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        made.append(out_dir / name)
    return made


def short_command(cmd: str, cwd: str | None = None) -> str:
    """The command as docs show it: paths relative to the checkout, and a run of adapter arguments
    (synth-00000 ... synth-00031, space- or comma-separated) as its first and last with a count."""
    import os
    import re

    cmd = cmd.replace((cwd or os.getcwd()).rstrip("/") + "/", "")
    parts = re.split(r"([ ,])", cmd)
    out, run = [], []

    def flush():
        if len(run) > 5:  # token, sep, token, ...: keep the first and the last
            n = (len(run) + 1) // 2
            out.extend([run[0], run[1], f"... ({n} adapters) ...", run[1], run[-1]])
        else:
            out.extend(run)
        run.clear()

    for part in parts:
        if "synth-" in part or (run and part in (" ", ",") and "synth-" in run[-1]):
            run.append(part)
        else:
            if run and run[-1] in (" ", ","):
                sep = run.pop()
                flush()
                out.append(sep)
            else:
                flush()
            out.append(part)
    flush()
    return "".join(out)


def zipf_setup(meta: dict) -> list[str]:
    """How W6 ran: its adapter set, sizes, the law, how each of its servers holds the set."""
    z = meta.get("zipf")
    if not z:
        return []
    peers = [s["peer"] for s in meta["servers"] if "W6" in workloads_of(s, meta)]
    holds = {"ours": "ours registers them all through its registry once up (ready after, below, includes it) and "
                     "fetches one on first use",
             "vllm": f"vLLM loads every one into its CPU cache at start-up (`--lora-modules`, `--max-cpu-loras "
                     f"{z['adapters']}`)",
             "llamacpp": "llama-server loads every one at start-up" + (
                 f" ({z['gguf_bytes'] / z['adapters'] / 1e6:.1f} MB each as GGUF, {z['gguf_bytes'] / 1e9:.2f} GB "
                 "in all)" if z.get("gguf_bytes") else "")}
    return [f"**W6** runs in a second phase: once W1-W5's servers have stopped, "
            f"{', '.join(NAMES.get(p, p) for p in peers) or 'no server'} start again with W6's own "
            f"{z['adapters']:,} random rank-{z['rank']} PEFT adapters on {', '.join(z['target_modules'])} (seeded; "
            f"{z['adapter_bytes'] / 1e6:.1f} MB each as float32 safetensors, {z['total_bytes'] / 1e9:.2f} GB in all). "
            f"A request's adapter is drawn by a Zipf law, popularity rank k with probability proportional to "
            f"1/k^{z['exponent']}, seeded per round: every server meets the same sequence in a round. "
            f"{z['device_slots']} device adapter slots (ours `--slots`, vLLM `--max-loras`); "
            + "; ".join(holds[p] for p in peers if p in holds)
            + ". Warm-up: one base request and one on the least popular adapter per server, not measured.", ""]


def render(data: dict, to: Path, results: Path, notes: str | None = None) -> Path:
    meta, summary = data["meta"], summarise(data)
    pngs = plots(data, summary, to / "peers")
    loads = [_f(r["load1"]) for r in data["rounds"]] + [_f(r["load1_end"]) for r in data["rounds"]]
    loads = [x for x in loads if x is not None]
    md = ["# Peers side by side", "",
          f"Generated by `python -m benchmarks.peers.report --from {results} --to {to}` from the raw CSVs of:", "",
          "```bash", meta["command"], "```", "",
          f"Model `{Path(meta['model']).name}` in float32; "
          + (f"{len(meta['adapters'])} random rank-16 PEFT adapters on all 7 projections (seeded); " if meta["adapters"] else "")
          + f"streamed chat through the official `openai` client, max_tokens {meta['max_tokens']}, "
          f"greedy; {meta['rounds']} interleaved round(s), every server once per round in a shuffled order; "
          f"{meta['threads']} intra-op threads per server on a {meta['cpus']}-CPU machine ({meta['platform']}); "
          f"servers not being measured: {meta.get('idle_servers', 'running')}.", "",
          *zipf_setup(meta),
          f"**Machine load** (1-minute load average): {_num(meta['load_at_start'][0], 2)} at the start"
          + (f", {_num(min(loads), 2)}-{_num(max(loads), 2)} over the rounds" if loads else "")
          + (f", {_num(meta['load_at_end'][0], 2)} at the end" if meta.get("load_at_end") else " (the run did not finish)")
          + ". Figures on a loaded machine are upper bounds on latency and lower bounds on throughput.", "",
          "## Tokens/s and time to first token", "",
          "Tokens/s: median over rounds of a batch's completion tokens / its wall time. TTFT: first chunk carrying "
          "a token, over all requests of all rounds. Ratios: ours / the peer (above 1: ours is faster).", "",
          *table(data, summary), ""]
    tpots = {p: summary.get(("W4", p), {}).get("tpot") for p in peers_of(meta)}
    if any(tpots.values()):
        md += ["Single-stream time per output token (W4, median): "
               + ", ".join(f"{NAMES.get(p, p)} {t * 1000:.1f} ms" for p, t in tpots.items() if t) + ".", ""]
        spec = re.search(r"--speculate[ =](\d+)", json.dumps(meta))
        n = int(spec.group(1)) if spec else SPECULATE_TOKENS
        ours = ("ours off (`--speculate 0`)" if n == 0 else
                f"ours {'at its default' if not spec else 'with'} `--speculate {n}` (a greedy request running alone "
                f"gets up to {n} n-gram draft token(s) checked in each step; the answer is plain decoding's, token for "
                "token: handler/engine/speculate.py)")
        md += [f"Speculative decoding: {ours}; llama.cpp at its default (`--spec-type none`); vLLM without a "
               "speculative config (its default).", ""]
    if tgt := targets(data, summary):
        md += ["## Issue 22's targets", "", *tgt, ""]
    md += [f"![tokens/s]({pngs[0].relative_to(to)})", "", f"![TTFT]({pngs[1].relative_to(to)})", ""]
    md += ["## Greedy agreement", ""]
    if data["agreement"]:
        md += ["Same prompts, greedy, on the base and two adapters; each server's text compared with the first "
               "server's (reference).", "", "| model | server | same text as the reference |", "| --- | --- | --- |"]
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in data["agreement"]:
            groups.setdefault((r["model"], r["peer"]), []).append(r)
        for (model, peer), rs in groups.items():
            same = sum(r["same_as_reference"] == "True" for r in rs)
            md.append(f"| {model} | {NAMES.get(peer, peer)} | {same} of {len(rs)} prompts (reference: "
                      f"{NAMES.get(rs[0]['reference'], rs[0]['reference'])}) |")
    else:
        md.append("Not run.")
    md += ["", "## Servers", "", "| server | workloads | version | threads | ready after (s) | installed |",
           "| --- | --- | --- | --- | --- | --- |"]
    for s in meta["servers"]:
        md.append(f"| {NAMES.get(s['peer'], s['peer'])} | {' '.join(workloads_of(s, meta))} | {s['version']} | "
                  f"{s['threads']} | {_num(s['startup_s'], 0)} | {s['how']} |")
    md += ["", "Exact commands (environment: each server's thread variables; a run of adapter arguments shown as its "
           "first and last):", ""]
    for s in meta["servers"]:
        env = " ".join(f"{k}={v}" for k, v in s["env"].items())
        md += [f"{NAMES.get(s['peer'], s['peer'])} ({', '.join(workloads_of(s, meta))}):", "", "```bash", (env + " " if env else "") + short_command(s["command"]),
               "```", ""]
    if meta.get("skipped"):
        md += ["Not run: " + "; ".join(f"{NAMES.get(k['peer'], k['peer'])} {k['workload']} ({k['why']})"
                                      for k in meta["skipped"]) + ".", ""]
    md += ["## Load per round", "", "| round | workloads | order | load1 at start | load1 at end | wall (s) |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in data["rounds"]:
        md.append(f"| {r['round']} | {' '.join(workloads_of(r, meta))} | {r['order']} | {_num(_f(r['load1']), 2)} | "
                  f"{_num(_f(r['load1_end']), 2)} | {r['wall_s']} |")
    if notes:
        md += ["", "## Notes", "", notes.strip()]
    to.mkdir(parents=True, exist_ok=True)
    out = to / "peers.md"
    out.write_text("\n".join(md) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="results", type=Path, default=Path("var/peers/results"))
    p.add_argument("--to", type=Path, default=Path("docs"))
    p.add_argument("--notes", type=Path, default=None, help="markdown added as a Notes section")
    args = p.parse_args(argv)
    try:
        notes = args.notes.read_text() if args.notes else None
        out = render(load(args.results), args.to, args.results, notes)
    except CliError as e:
        print(f"peers report: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"peers report: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
