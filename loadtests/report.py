"""The load test's report, rebuilt from the CSVs in a results folder (so it can be regenerated):
sweep.csv (one row per step and group: all, then each tier), ab.csv, throughput.csv, meta.json.
A prefix cache A/B (`--ab-prefix-cache`: sweeps `prefix-on` and `prefix-off` in sweep.csv) gets a
section of its own comparing the two.

Writes report.md and three plots (matplotlib, PNG): TTFT p95 vs rate by tier, hit rates vs rate,
and the TTFT CDF of each step.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

SLO_S = 1.0  # the product's promise: p95 time to first token under 1 s
TIER_ORDER = ("all", "gpu", "ram", "disk", "remote", "base")


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _f(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _ms(value) -> str:
    v = _f(value)
    return "-" if math.isnan(v) else f"{v:.0f}"


def _pct(value) -> str:
    v = _f(value)
    return "-" if math.isnan(v) else f"{100 * v:.1f}%"


def _num(value, digits: int = 1) -> str:
    v = _f(value)
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def steps(sweep: list[dict]) -> dict[tuple[str, float], dict[str, dict]]:
    """(run, rate) -> {group: row}, in file order."""
    out: dict[tuple[str, float], dict[str, dict]] = {}
    for r in sweep:
        out.setdefault((r["run"], _f(r["rate"])), {})[r["group"]] = r
    return out


def highest_ok_rate(sweep: list[dict], run: str) -> float | None:
    """The highest swept rate whose p95 TTFT (all requests) is under 1 s with zero errors, every lower
    rate passing too (a pass above a failure is luck, not capacity)."""
    best = None
    for (r, rate), groups in sorted(steps(sweep).items(), key=lambda kv: kv[0][1]):
        if r != run:
            continue
        row = groups.get("all", {})
        if _f(row.get("ttft_p95_ms")) < 1000 * SLO_S and int(row.get("errors") or 0) == 0:
            best = rate
        else:
            break
    return best


def _sweep_table(sweep: list[dict], run: str) -> list[str]:
    by_step = {k: v for k, v in steps(sweep).items() if k[0] == run}
    tiers = [t for t in TIER_ORDER[1:] if any(t in g for g in by_step.values())]
    head = ["rate req/s", "sent req/s", "requests", "errors", "TTFT p50", "TTFT p95", "TTFT p99"]
    head += [f"{t} p50/p95 (n)" for t in tiers]
    head += ["TPOT p50/p95", "device hit", "RAM hit", "loads/min", "evictions/min", "CPU busy", "errors by kind"]
    prefix = any(not math.isnan(_f(g["all"].get("prefix_hit_rate"))) or not math.isnan(_f(g["all"].get("cached_share")))
                 for g in by_step.values() if "all" in g)  # fmt: skip
    if prefix:  # only where the replicas or the answers reported a prefix cache
        head[-1:-1] = ["prefix hit", "cached share"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for (_, rate), g in by_step.items():
        a = g["all"]
        cells = [_num(rate, 2), _num(a["achieved_rate"], 2), a["requests"], a["errors"],
                 _ms(a["ttft_p50_ms"]), _ms(a["ttft_p95_ms"]), _ms(a["ttft_p99_ms"])]  # fmt: skip
        for t in tiers:
            row = g.get(t)
            cells.append(f"{_ms(row['ttft_p50_ms'])}/{_ms(row['ttft_p95_ms'])} ({row['requests']})" if row else "-")
        cells += [f"{_ms(a['tpot_p50_ms'])}/{_ms(a['tpot_p95_ms'])}", _pct(a["device_hit_rate"]),
                  _pct(a["ram_hit_rate"]), _num(a["loads_per_min"]), _num(a["evictions_per_min"]),
                  _pct(a.get("cpu_busy")), a.get("errors_by_kind") or "none"]  # fmt: skip
        if prefix:
            cells[-1:-1] = [_pct(a.get("prefix_hit_rate")), _pct(a.get("cached_share"))]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def prefix_ab_lines(sweep: list[dict], meta: dict) -> list[str]:
    """The prefix cache A/B section (sweeps prefix-on and prefix-off), or nothing without both."""
    by_step = steps(sweep)
    on = {rate: g["all"] for (r, rate), g in by_step.items() if r == "prefix-on" and "all" in g}
    off = {rate: g["all"] for (r, rate), g in by_step.items() if r == "prefix-off" and "all" in g}
    if not on or not off:
        return []
    w = meta.get("workload", {})
    lines = ["## Prefix cache A/B (same seeded replay)", "",
             f"Each sweep on a fresh farm: `prefix-on` (the replicas' default) first, then `prefix-off` (replicas "
             f"started with `--no-prefix-cache`); {_pct(w.get('system_prompt_share'))} of requests carry their "
             f"adapter's system prompt (log-normal, median {_f(w.get('system_prompt_median')):g} words, sigma "
             f"{w.get('system_prompt_sigma')}, cap {w.get('system_prompt_cap')}, the same text per adapter "
             f"throughout); the k-th rate step draws its requests with seed {w.get('seed')} + k in both sweeps.", "",
             "| rate req/s | requests on/off | errors on/off | TTFT p50 on | TTFT p50 off | TTFT p95 on | TTFT p95 off "
             "| p95 on/off | prefix hit (on) | cached share on/off | load avg on/off |",
             "| ---: |" + " ---: |" * 10]  # fmt: skip
    for rate in sorted(set(on) | set(off)):
        a, b = on.get(rate, {}), off.get(rate, {})
        ratio = _f(a.get("ttft_p95_ms")) / _f(b.get("ttft_p95_ms")) if _f(b.get("ttft_p95_ms")) else math.nan

        def load(row: dict) -> str:
            return f"{_num(row.get('load_start'))}-{_num(row.get('load_end'))}" if row else "-"

        lines.append(f"| {_num(rate, 2)} | {a.get('requests', '-')}/{b.get('requests', '-')} | "
                     f"{a.get('errors', '-')}/{b.get('errors', '-')} | {_ms(a.get('ttft_p50_ms'))} | "
                     f"{_ms(b.get('ttft_p50_ms'))} | {_ms(a.get('ttft_p95_ms'))} | {_ms(b.get('ttft_p95_ms'))} | "
                     f"{_num(ratio, 2)} | {_pct(a.get('prefix_hit_rate'))} | {_pct(a.get('cached_share'))}/"
                     f"{_pct(b.get('cached_share'))} | {load(a)} / {load(b)} |")  # fmt: skip
    best_on, best_off = highest_ok_rate(sweep, "prefix-on"), highest_ok_rate(sweep, "prefix-off")

    def best(x: float | None) -> str:
        return "none of the rates swept" if x is None else f"{x:g} req/s"

    lines += ["", f"**Highest rate with p95 TTFT < 1 s and zero errors: {best(best_on)} with the prefix cache, "
              f"{best(best_off)} without.**", "",
              "TTFT in ms. Prefix hit: prompt tokens served from the prefix cache over prompt tokens looked up, "
              "from the replicas' lorafarm_prefix_cache_hits_total / lorafarm_prefix_cache_queries_total over the "
              "measured window. Cached share: the sum of the answers' usage.prompt_tokens_details.cached_tokens "
              "over the sum of their prompt_tokens. Load avg: the machine's 1-minute load average at the window's "
              "start-end.", ""]  # fmt: skip
    return lines


def _save(fig, results: Path, name: str) -> str:
    """Lay out, write results/name as PNG, close the figure; returns the name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(results / name, dpi=110)
    plt.close(fig)
    return name


def plot_all(results: Path, sweep: list[dict], ab: list[dict]) -> list[str]:
    """Draw the PNGs into `results`; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step = steps(sweep)
    runs = list(dict.fromkeys(r for r, _ in by_step))
    styles = ["-", "--", ":", "-."]
    names = []

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, run in enumerate(runs):
        for tier in TIER_ORDER:
            pts = [(rate, _f(g[tier]["ttft_p95_ms"])) for (r, rate), g in by_step.items() if r == run and tier in g]
            pts = [(x, y) for x, y in pts if not math.isnan(y)]
            if pts:
                ax.plot(*zip(*pts), styles[i % len(styles)], marker="o", label=f"{run}: {tier}")
    ax.axhline(1000 * SLO_S, color="red", lw=0.8, ls="--", label="1 s")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (requests/s, Poisson)")
    ax.set_ylabel("TTFT p95 (ms)")
    ax.set_title("p95 time to first token by tier (x-adapter-tier)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    names.append(_save(fig, results, "ttft_p95_by_tier.png"))

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, run in enumerate(runs):
        for key, label in (("device_hit_rate", "device"), ("ram_hit_rate", "RAM (of misses)"),
                           ("prefix_hit_rate", "prefix cache (prompt tokens)")):
            pts = [(rate, _f(g["all"].get(key))) for (r, rate), g in by_step.items() if r == run and "all" in g]
            pts = [(x, y) for x, y in pts if not math.isnan(y)]
            if pts:
                ax.plot(*zip(*pts), styles[i % len(styles)], marker="o", label=f"{run}: {label}")
    for row in ab:
        ax.scatter([_f(row["rate"])], [_f(row["device_hit_rate"])], marker="x", s=60, label=f"A/B {row['routing']}: device")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("hit rate")
    ax.set_title("adapter (and prefix) cache hit rates (replicas' /metrics)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    names.append(_save(fig, results, "hit_rate.png"))

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    curves = [(f"{r} @ {rate:g}/s", results / "steps" / f"{r}-{rate:g}-requests.csv") for r, rate in by_step]
    curves += [(f"A/B {row['routing']} @ {_f(row['rate']):g}/s", results / "steps" / f"ab-{row['routing']}-requests.csv")
               for row in ab]  # fmt: skip
    for label, path in curves:
        ttft = sorted(1000 * _f(r["ttft_s"]) for r in _rows(path) if r["phase"] == "measure" and r["ttft_s"])
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=label, lw=1)
    ax.axhline(0.95, color="grey", lw=0.5, ls="--")
    ax.axvline(1000 * SLO_S, color="red", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    names.append(_save(fig, results, "ttft_cdf.png"))
    return names


def render(results: Path, assets: str = "") -> str:
    """report.md's text for the results in `results`; image links are prefixed with `assets`."""
    meta = json.loads((results / "meta.json").read_text()) if (results / "meta.json").exists() else {}
    sweep = _rows(results / "sweep.csv")
    ab = _rows(results / "ab.csv")
    tput = _rows(results / "throughput.csv")
    images = plot_all(results, sweep, ab) if sweep else []
    runs = list(dict.fromkeys(r["run"] for r in sweep))
    w = meta.get("workload", {})
    lines = ["# Load test", ""]
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines += [
        f"Conditions: {meta.get('conditions', 'not recorded')}.",
        "",
        f"Workload: Zipf(s={w.get('zipf')}) over {meta.get('adapters', '?')} adapters (most popular first), "
        f"open-loop Poisson arrivals, prompts log-normal (median {w.get('prompt_median')} words, "
        f"sigma {w.get('prompt_sigma')}), outputs log-normal (median {w.get('output_median')} tokens, sigma "
        f"{w.get('output_sigma')}, cap {w.get('output_cap')}, `ignore_eos`)"
        + (f", lengths and gaps from trace {w['trace']}" if w.get("trace") else "")
        + (f"; {_pct(w['system_prompt_share'])} of requests carry their adapter's shared system prompt as the chat "
           f"system message (one per adapter, seeded; log-normal, median {_f(w.get('system_prompt_median')):g} words, "
           f"sigma {w.get('system_prompt_sigma')}, cap {w.get('system_prompt_cap')})"
           if _f(w.get("system_prompt_share")) > 0 else "")
        + f"; each step {meta.get('warmup')} s warm-up then {meta.get('duration')} s measured. Streamed "
        "chat completions through the router; tiers from the `x-adapter-tier` header.",
        "",
    ]
    if meta.get("synth"):
        lines += [f"Adapters: `lorafarm adapters synth` {meta['synth']}.", ""]
    for run in runs:
        info = meta.get("runs", {}).get(run, {})
        lines += [f"## Sweep `{run}`", ""]
        if info:
            lines += [f"{info.get('replicas')} replicas, {info.get('slots')} device slots per rank pool, "
                      f"routing {info.get('routing')}"
                      + (f", prefix cache {info['prefix_cache']}" if info.get("prefix_cache") else "") + ".", ""]  # fmt: skip
        lines += _sweep_table(sweep, run)
        best = highest_ok_rate(sweep, run)
        lines += ["", f"**Highest rate with p95 TTFT < 1 s and zero errors: "
                  f"{'none of the rates swept' if best is None else f'{best:g} req/s'}.**", ""]  # fmt: skip
        lines += ["TTFT and TPOT in ms. Device hit: requests whose adapter was in a device slot; RAM hit: device "
                  "misses served from host RAM; loads and evictions are device-slot loads/evictions per minute "
                  "summed over the replicas. CPU busy: the whole machine's CPU use over the window (all cores, "
                  "/proc/stat), everything included (farm, load generator, other jobs).", ""]  # fmt: skip
    lines += prefix_ab_lines(sweep, meta)
    if ab:
        lines += ["## Routing A/B (same seeded replay)", "",
                  "| routing | rate | requests | errors | TTFT p50 | TTFT p95 | TTFT p99 | device hit | RAM hit | "
                  "loads/min | evictions/min |", "| --- |" + " ---: |" * 10]  # fmt: skip
        for r in ab:
            lines.append(f"| {r['routing']} | {_num(r['rate'], 2)} | {r['requests']} | {r['errors']} | "
                         f"{_ms(r['ttft_p50_ms'])} | {_ms(r['ttft_p95_ms'])} | {_ms(r['ttft_p99_ms'])} | "
                         f"{_pct(r['device_hit_rate'])} | {_pct(r['ram_hit_rate'])} | {_num(r['loads_per_min'])} | "
                         f"{_num(r['evictions_per_min'])} |")  # fmt: skip
        lines.append("")
    if tput:
        lines += ["## Throughput: distinct adapters in flight vs the base model", "",
                  "| models in flight | concurrency | requests | errors | output tokens/s | vs base | TTFT p50 | TPOT p50 |",
                  "| --- |" + " ---: |" * 7]  # fmt: skip
        for r in tput:
            lines.append(f"| {r['label']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
                         f"{_num(r['output_tokens_per_s'])} | {_num(r['ratio_vs_base'], 2)} | "
                         f"{_ms(r['ttft_p50_ms'])} | {_ms(r['tpot_p50_ms'])} |")  # fmt: skip
        lines.append("")
    for name in images:
        lines += [f"![{name}]({assets}{name})", ""]
    lines += ["Raw data: sweep.csv (per step and tier), ab.csv, throughput.csv, steps/*-requests.csv (one row per "
              "request), steps/*_stats.csv (locust's own CSVs, split by tier).", ""]  # fmt: skip
    return "\n".join(lines)


def write_report(results: Path) -> Path:
    out = results / "report.md"
    out.write_text(render(results))
    return out


def publish(results: Path, docs: Path, name: str = "loadtests") -> Path:
    """Copy a run's report to `docs/<name>.md` and its plots and CSVs to `docs/<name>/`."""
    assets = docs / name
    assets.mkdir(parents=True, exist_ok=True)
    text = render(results, assets=f"{name}/")
    for png in results.glob("*.png"):
        shutil.copy2(png, assets / png.name)
    for f in ("sweep.csv", "ab.csv", "throughput.csv", "meta.json"):
        if (results / f).exists():
            shutil.copy2(results / f, assets / f)
    if (results / "steps").is_dir():
        (assets / "steps").mkdir(exist_ok=True)
        for f in (results / "steps").glob("*-requests.csv"):
            shutil.copy2(f, assets / "steps" / f.name)
    md = docs / f"{name}.md"
    text = text.replace("Raw data: ", f"Raw data (in {name}/): ")
    from loadtests.real_report import kept_section, splice

    if section := kept_section(md.read_text() if md.exists() else ""):  # `make loadtest-real-docs`' section stays
        text = splice(text, section)
    md.write_text(text)
    return md

