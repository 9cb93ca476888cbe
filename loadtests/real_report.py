"""docs/loadtests.md's real-model section and docs/loadtests/real_*.png from a `make loadtest-real` run.

    python -m loadtests.real report --from var/loadtest-real --to docs     (make loadtest-real-docs)

The section sits between BEGIN and END at the top of docs/loadtests.md (after its title); the rest of
the file (the dev-model sweep, rendered by `make loadtest-docs`) is left as it is, and that command
keeps this section in turn (loadtests.report.publish). A hand-written reading of the run, when
docs/loadtests/real-notes.md exists, is appended to the section as it stands.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

BEGIN = "<!-- loadtest-real:start (rendered by `make loadtest-real-docs`; edit docs/loadtests/real-notes.md) -->"
END = "<!-- loadtest-real:end -->"
NOTES = "real-notes.md"
PLOTS = ("real_ttft_p95.png", "real_ttft_p95_by_tier.png", "real_hit_rate.png")
TIER_ORDER = ("gpu", "ram", "disk", "remote", "base", "first use", "repeat")
TIER_NAMES = {"gpu": "device", "ram": "RAM", "disk": "disk", "remote": "store", "base": "base",
              "first use": "first use", "repeat": "repeat"}  # fmt: skip


def read_steps(src: Path) -> list[dict]:
    with open(src / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k not in ("system", "group", "errors_by_kind"):
                try:
                    r[k] = float(v) if v not in ("", None) else math.nan
                except ValueError:
                    pass
    return rows


def goodput(rows: list[dict], system: str) -> float:
    """The highest rate whose step met the SLO (0 when none did)."""
    met = [r["rate"] for r in rows if r["system"] == system and r["group"] == "all" and r.get("slo_met") == 1]
    return max(met, default=0.0)


def _f(v: float, fmt: str = ".0f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _pct(v: float) -> str:
    return "-" if isinstance(v, float) and math.isnan(v) else f"{100 * v:.0f}%"


def step_table(rows: list[dict], system: str) -> list[str]:
    tiers = [t for t in TIER_ORDER if any(r["system"] == system and r["group"] == t for r in rows)]
    head = ["rate", "sent", "achieved", "requests", "errors", "TTFT p50", "TTFT p95", "TTFT p99",
            *[f"{TIER_NAMES[t]} p50/p95 (n)" for t in tiers], "TPOT p50/p95", "wrong markers", "device hit",
            "loads/min", "evictions/min", "CPU busy", "server CPU", "load", "SLO", "errors by kind"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" ---: " for _ in head) + "|"]
    for r in [r for r in rows if r["system"] == system and r["group"] == "all"]:
        by = {g["group"]: g for g in rows if g["system"] == system and g["rate"] == r["rate"]}
        cells = [f"{r['rate']:g}", _f(r["sent_rate"], ".2f"), _f(r["achieved_rate"], ".2f"), _f(r["requests"]),
                 _f(r["errors"]), _f(r["ttft_p50_ms"]), _f(r["ttft_p95_ms"]), _f(r["ttft_p99_ms"])]  # fmt: skip
        for t in tiers:
            g = by.get(t)
            cells.append(f"{_f(g['ttft_p50_ms'])}/{_f(g['ttft_p95_ms'])} ({_f(g['requests'])})" if g else "-")
        cells += [f"{_f(r['tpot_p50_ms'])}/{_f(r['tpot_p95_ms'])}", f"{_f(r['wrong_markers'])} of {_f(r['canary_requests'])}",
                  _pct(r["device_hit_rate"]), _f(r["loads_per_min"], ".1f"), _f(r["evictions_per_min"], ".1f"),
                  _pct(r["cpu_busy"]), _f(r["server_cpu"], ".2f"), f"{_f(r['load_start'], '.1f')}-{_f(r['load_end'], '.1f')}",
                  "met" if r["slo_met"] == 1 else "**missed**", r["errors_by_kind"] or "none"]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return out


def client_ttft_mean_ms(src: Path, system: str, rate: float) -> float:
    path = src / "requests" / f"{system}-{rate:g}.csv"
    if not path.exists():
        return math.nan
    with open(path, newline="") as f:
        vals = [float(r["ttft_s"]) for r in csv.DictReader(f) if r["phase"] == "measure" and not r["error"]]
    return 1000 * sum(vals) / len(vals) if vals else math.nan


def profile_table(rows: list[dict], src: Path) -> list[str]:
    """Where ours' time went per step (the replica's /metrics over the window): the knee's profile."""
    head = ["rate", "client TTFT mean", "replica TTFT mean", "queue mean (load + wait for a row)",
            "slot load mean (n)", "prompt tok/s", "generated tok/s", "server CPU s/s", "CPU busy", "SLO"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" ---: " for _ in head) + "|"]
    for r in [r for r in rows if r["system"] == "ours" and r["group"] == "all"]:
        out.append("| " + " | ".join([
            f"{r['rate']:g}", _f(client_ttft_mean_ms(src, "ours", r["rate"])), _f(r.get("replica_ttft_mean_ms", math.nan)),
            _f(r.get("replica_queue_mean_ms", math.nan)),
            f"{_f(r.get('slot_load_mean_ms', math.nan))} ({_f(r.get('slot_loads', math.nan))})",
            _f(r.get("prompt_tokens_per_s", math.nan)), _f(r.get("generated_tokens_per_s", math.nan)),
            _f(r["server_cpu"], ".2f"), _pct(r["cpu_busy"]), "met" if r["slo_met"] == 1 else "**missed**"]) + " |")
    return out


def plots(rows: list[dict], systems: list[str], to: Path, fleet: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    to.mkdir(parents=True, exist_ok=True)
    made = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in systems:
        pts = [(r["rate"], r["ttft_p95_ms"]) for r in rows if r["system"] == s and r["group"] == "all"]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=s)
    ax.axhline(1000, color="grey", ls="--", lw=1, label="SLO 1 s")
    ax.set(xlabel="offered rate (req/s)", ylabel="p95 TTFT (ms)", yscale="log",
           title=f"p95 time to first token vs rate, {fleet}")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(to / PLOTS[0], dpi=110)
    plt.close(fig)
    made.append(PLOTS[0])
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in systems:
        for t in TIER_ORDER:
            pts = [(r["rate"], r["ttft_p95_ms"]) for r in rows if r["system"] == s and r["group"] == t]
            if pts:
                ax.plot(*zip(*pts), marker="o" if s == "ours" else "s", ls="-" if s == "ours" else ":",
                        label=f"{s}: {TIER_NAMES[t]}")  # fmt: skip
    ax.axhline(1000, color="grey", ls="--", lw=1)
    ax.set(xlabel="offered rate (req/s)", ylabel="p95 TTFT (ms)", yscale="log",
           title="p95 TTFT by where the adapter was found")  # fmt: skip
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(to / PLOTS[1], dpi=110)
    plt.close(fig)
    made.append(PLOTS[1])
    ours = [r for r in rows if r["system"] == "ours" and r["group"] == "all"]
    if ours:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["rate"] for r in ours], [100 * r["device_hit_rate"] for r in ours], marker="o", label="device hit")
        ax.set(xlabel="offered rate (req/s)", ylabel="% of adapter requests", ylim=(0, 100),
               title="ours: requests whose adapter was already in a device slot")  # fmt: skip
        fig.tight_layout()
        fig.savefig(to / PLOTS[2], dpi=110)
        plt.close(fig)
        made.append(PLOTS[2])
    return made


def _when(unix: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(unix)) if unix else "?"


def render(src: Path, to: Path) -> str:
    meta = json.loads((src / "meta.json").read_text())
    rows = read_steps(src)
    systems = [s for s in meta["systems"] if any(r["system"] == s for r in rows)]
    made = plots(rows, systems, to / "loadtests", f"{meta['adapters']:,} adapters")
    shape = meta["adapter_shape"]
    chat = meta["chat"]
    gp = {s: goodput(rows, s) for s in systems}
    ratio = gp["ours"] / gp["vllm"] if gp.get("vllm") and "ours" in gp else math.nan
    title = f"{Path(meta['model']).name}, {meta['adapters']:,} adapters"
    lines = [BEGIN, "", f"## Real model ({title}): ours vs vLLM CPU on its long-tail path", "",
             f"Command: `make loadtest-real` (`{meta['command']}`), then `make loadtest-real-docs`. Run "
             f"{_when(meta['started_unix'])} to {_when(meta.get('finished_unix'))}.", "",
             f"Conditions: {meta['cpus']} CPU cores shared with other jobs ({meta['platform']}); load average "
             f"{meta['load_at_start'][0]:.1f} at the start, {(meta.get('load_at_end') or [math.nan])[0]:.1f} at the end "
             "(per step in the tables); each server on "
             f"{meta['threads']} threads, the one not measured paused (SIGSTOP); the systems alternate rate by rate "
             "in ABBA order over the same seeded arrival sequence; the load generator runs on the same machine.", "",
             f"Fleet: {meta['adapters']:,} PEFT LoRA adapters of the one base ({len(meta['canaries'])} of them canaries, "
             f"popularity ranks {', '.join(str(c['popularity_rank']) for c in meta['canaries'].values()) or '-'}), synthetic "
             f"(loadtests.synth, seed {meta['seed']}): ranks {'/'.join(map(str, shape['ranks']))} in shares "
             f"{'/'.join(f'{100 * v:.0f}' for v in shape['rank_shares'].values())}%, targets "
             f"{', '.join(shape['targets'])}, {shape['dtype']}: {meta['adapter_bytes'] / 1e9:.2f} GB in one folder "
             "that both systems serve (ours uploads each through its registry, which stores its own copy; vLLM "
             "resolves `<folder>/<name>` on first use).", "",
             f"Traffic: open-loop Poisson arrivals; {100 * meta['base_share']:.0f}% on the base model, the rest "
             f"Zipf({chat['zipf_s']}) over the adapters; chat turns with log-normal lengths: user prompt median "
             f"{chat['prompt_words_median']} words (sigma {chat['prompt_words_sigma']}, cap {chat['prompt_words_cap']}), "
             f"output median {chat['max_tokens_median']} tokens (sigma {chat['max_tokens_sigma']}, cap "
             f"{chat['max_tokens_cap']}, `ignore_eos` so both systems decode the same tokens), "
             f"{100 * chat['system_prompt_share']:.0f}% of requests with their adapter's shared system prompt (median "
             f"{chat['system_prompt_words_median']} words); a request that draws a canary asks it its own prompt "
             "greedily and must answer exactly its marker (its known answer, computed with PEFT). Streamed chat completions through the official `openai` client "
             f"(AsyncOpenAI). Each step: {meta['warmup_s']:g} s warm-up, {meta['window_s']:g} s measured, at most "
             f"{meta['drain_s']:g} s for the window's requests to finish (those still open count as errors "
             "`unfinished`); a system leaves the sweep after --stop-after consecutive steps that miss the SLO "
             "(--keep-going: none does).", ""]
    lines += ["Servers:", ""]
    for s in systems:
        d = meta["servers"].get(s, {})
        env = " ".join(f"{k}={v}" for k, v in sorted(d.get("env", {}).items()))
        lines.append(f"- **{s}** ({d.get('version', '?')}; ready in {d.get('startup_s', '?')} s): `{d.get('command', '?')}`"
                     + (f" with `{env}`" if env else ""))
    lines += ["", "### Goodput: the highest rate with p95 TTFT < 1 s, zero errors and zero wrong markers", "",
              "| system | goodput req/s |", "| --- | ---: |"]
    lines += [f"| {s} | {gp[s]:g} |" for s in systems]
    if not math.isnan(ratio):
        lines += ["", f"**Ratio ours / vLLM: {ratio:.1f}x** (one interleaved run; load in the tables)."]
    elif gp.get("vllm") == 0 and gp.get("ours"):
        lines += ["", "**vLLM met the SLO at no rate of the sweep**: the ratio is above "
                  f"{gp['ours'] / min(meta['rates']):.0f}x (ours' goodput over the sweep's lowest rate)."]
    for s in systems:
        lines += ["", f"### {s}", ""] + step_table(rows, s)
    if "ours" in systems:
        lines += ["", "### Where ours' time goes (the profile at the knee)", "",
                  "Means over each window's requests, in ms, from the replica's /metrics (replica TTFT: arrival at "
                  "the replica to its first token; queue: arrival to the engine, i.e. adapter load plus waiting for "
                  "a batch row; slot load: one adapter into a device slot) and the client (client TTFT: send to "
                  "first token, router and HTTP included); server CPU: CPU seconds per second of ours' processes "
                  "(registry, router, replica: 2.0 is both cores).", ""] + profile_table(rows, src)
    lines += ["", "Rates in req/s (sent and achieved over the measured window: achieved = answered without error); "
              "TTFT and TPOT in ms. Tiers for ours from the replica's `x-adapter-tier` header: device = a device "
              "slot (`gpu`), RAM, disk, store = fetched from the registry's store (`remote`), base = the base model (ours' replica "
              "reports a base-model request as `gpu`: they are in the device column). "
              "vLLM names no tier: `first use` = the first request for that adapter since the server started "
              "(resolved from the folder and loaded), `repeat` = seen before (in its CPU cache or evicted and "
              "reloaded: vLLM does not say). Device hit, loads/min and evictions/min: ours' replica /metrics over "
              "the window. CPU busy: the whole machine (all cores, /proc/stat); server CPU: the measured server's "
              "processes, CPU seconds per second over the step; load: the 1-minute load average at the window's "
              "start and end.", ""]
    lines += [f"![{p}](loadtests/{p})" for p in made]
    lines += ["", f"Raw data: var/loadtest-real/ (steps.csv, requests/<system>-<rate>.csv one row per request, "
              "metrics/ the replica's /metrics at each window's ends, meta.json, logs/)."]
    notes = to / "loadtests" / NOTES
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    lines += ["", END]
    return "\n".join(lines) + "\n"


def splice(existing: str, section: str, begin: str = BEGIN, end: str = END) -> str:
    """`section` (from `begin` to `end`) in place of the one in `existing`, or after its title line when
    it has none."""
    if begin in existing and end in existing:
        head, rest = existing.split(begin, 1)
        return head + section.rstrip("\n") + rest.split(end, 1)[1]
    first, _, rest = existing.partition("\n")
    return f"{first}\n\n{section}\n{rest.lstrip(chr(10))}" if existing else section


def kept_section(existing: str, begin: str = BEGIN, end: str = END) -> str:
    """The rendered section (from `begin` to `end`) of a markdown text, or ''."""
    if begin in existing and end in existing:
        return begin + existing.split(begin, 1)[1].split(end, 1)[0] + end + "\n"
    return ""


def write_docs(src: Path, to: Path, scale: bool = False, progress: bool = True) -> Path:
    """docs/loadtests.md's section and plots; with `scale`, docs/scale.md's recalibration too (minutes:
    loadtests.real_scale runs the simulator)."""
    md = to / "loadtests.md"
    section = render(src, to)
    md.write_text(splice(md.read_text() if md.exists() else "# Load test\n", section))
    if scale:
        from loadtests.real_scale import write_docs as write_scale

        write_scale(src, to, progress)
    return md
