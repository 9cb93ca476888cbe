"""The fleet simulator recalibrated from `make loadtest-real`'s run of ours on the real model: service
figures fitted from that run, the simulator's prediction for that box beside what the sweep measured
(the validation factor), and how many such boxes carry the seed's 40 req/s at 5,000 adapters.

Rendered by `make loadtest-real-docs` into docs/scale.md between BEGIN and END (after its title); `make
scale` keeps the section (loadtests.scale_study). Fitted from ours' measured windows (not free parameters):

- decode step: the median TPOT p50 of the steps before the knee; the per-row term: the least-squares
  slope of TPOT p50 against the mean rows in flight (rate x mean end-to-end time, Little's law) over
  those steps, not below 0;
- prefill: median over device-hit and base requests of those steps of prompt tokens / (TTFT - one
  decode step): it absorbs the router, HTTP and tokenizer time as well;
- "before the knee": the steps with no error whose replica queue (arrival to the engine) averaged < 1 s;
- loads: RAM and disk into a slot, the replica's mean load time (lorafarm_adapter_load_seconds) weighted by
  loads over those steps; remote (the registry's store): TTFT p50 of store hits minus that of device hits,
  the seed's 0.4 s when none was seen;
- the box: the replica's rank pools from its log, its RAM tier (4 GiB) and disk tier in adapters of the
  fleet's mean size, max batch 32, the router's default overload threshold (8,192 tokens in flight);
- traffic: the run's Zipf exponent, adapters, mean prompt tokens (template and system prompt included, as
  the replica counted them) and mean output tokens; base-model requests are simulated as adapter requests
  and the prefix cache is off (the measured prompt tokens already include what it saved: conservative).
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from dataclasses import asdict
from pathlib import Path

from loadtests.runner import percentile
from loadtests.simulate import SimConfig, simulate

BEGIN = "<!-- loadtest-real-scale:start (rendered by `make loadtest-real-docs` from var/loadtest-real) -->"
END = "<!-- loadtest-real-scale:end -->"
SEED_RATE = 40.0
SEED_ADAPTERS = 5000
SEED_REPLICAS = 26  # the seed's plan: 26 GPU replicas (docs/scale.md)
RAM_BYTES = 4 << 30  # the replica's default --ram-bytes
SIM_S, SIM_WARMUP_S = 300.0, 60.0


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(r: dict, k: str) -> float | None:
    v = r.get(k, "")
    return float(v) if v not in ("", None) else None


def fit(src: Path) -> dict:
    """The service figures of ours' run in `src` (var/loadtest-real) and the box it ran on."""
    meta = json.loads((src / "meta.json").read_text())
    steps = [s for s in _rows(src / "steps.csv") if s["system"] == "ours" and s["group"] == "all"]
    if not steps:
        raise ValueError(f"{src}: no step of ours")
    steps.sort(key=lambda s: float(s["rate"]))
    # before the knee: no errors and the replica's queue (adapter load + wait for a row) under 1 s on average
    met = [s for s in steps if s["errors"] == "0" and float(s.get("replica_queue_mean_ms") or "nan") < 1000] or steps[:1]
    reqs = {float(s["rate"]): [r for r in _rows(src / "requests" / f"ours-{float(s['rate']):g}.csv")
                               if r["phase"] == "measure" and not r["error"]] for s in steps}  # fmt: skip
    decode = statistics.median(float(s["tpot_p50_ms"]) for s in met) / 1000
    xs, ys = [], []
    for s in met:
        rs = reqs[float(s["rate"])]
        e2e = statistics.fmean(_num(r, "e2e_s") for r in rs) if rs else 0.0
        xs.append(float(s["rate"]) * e2e)
        ys.append(float(s["tpot_p50_ms"]) / 1000)
    per_row = 0.0
    if len(xs) > 1 and max(xs) > min(xs):
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        per_row = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    lows = [r for s in met for r in reqs[float(s["rate"])] if r["tier"] in ("gpu", "base")]
    rates = [float(r["prompt_tokens"]) / (float(r["ttft_s"]) - decode) for r in lows
             if r["prompt_tokens"] and float(r["ttft_s"]) > decode]  # fmt: skip
    prefill = statistics.median(rates) if rates else 8000.0
    pooled = [r for s in met for r in reqs[float(s["rate"])]]

    def p50(tier: str) -> float | None:
        vals = [float(r["ttft_s"]) for r in pooled if r["tier"] == tier]
        return percentile(vals, 50) if vals else None

    # a load into a slot: the replica's own mean (lorafarm_adapter_load_seconds), weighted by loads, before
    # the knee; the client's TTFT by tier is too few requests per tier at these rates to difference
    n = sum(float(s.get("slot_loads") or 0) for s in met)
    slot_load = sum(float(s["slot_load_mean_ms"]) * float(s["slot_loads"]) for s in met
                    if s.get("slot_loads") and float(s["slot_loads"]) > 0) / n / 1000 if n else None  # fmt: skip
    load_s = {"gpu": 0.0, "ram": 0.008, "disk": 0.04, "remote": 0.4}
    seen = {}
    if slot_load is not None:
        for tier in ("ram", "disk"):
            load_s[tier] = seen[tier] = slot_load
    if p50("remote") is not None and p50("gpu") is not None:
        load_s["remote"] = seen["remote"] = max(0.0, p50("remote") - p50("gpu"))
    allr = [r for rs in reqs.values() for r in rs]
    log = src / "ours-state" / "logs" / "replica-r0.log"
    pools = {8: 8, 16: 8, 32: 8}
    # the log is appended to by every start over the kept state dir: the last start's pools are this run's
    if log.exists() and (found := re.findall(r"rank pools (\{[0-9:, ]+\})", log.read_text(errors="replace"))):
        pools = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", found[-1])}
    mean_bytes = meta["adapter_bytes"] / max(1, meta["adapters"])
    return {
        "decode_step_s": decode, "decode_step_per_row_s": per_row, "prefill_tokens_per_s": prefill,
        "load_s": load_s, "loads_measured": sorted(seen), "rank_pools": pools,
        "prompt_tokens": statistics.fmean(float(r["prompt_tokens"]) for r in allr if r["prompt_tokens"]),
        "output_tokens": statistics.fmean(float(r["output_tokens"]) for r in allr),
        "adapter_bytes": int(mean_bytes), "ram_adapters": int(RAM_BYTES // max(1.0, mean_bytes)),
        "zipf_s": meta["chat"]["zipf_s"], "adapters": meta["adapters"],
        "knee_steps": [float(s["rate"]) for s in met],
        "measured": {float(s["rate"]): {"p95_ttft_ms": float(s["ttft_p95_ms"]), "slo_met": s["slo_met"] == "1",
                                        "device_hit_rate": float(s["device_hit_rate"] or "nan")} for s in steps},
        "measured_goodput": max((float(s["rate"]) for s in steps if s["slo_met"] == "1"), default=0.0),
    }  # fmt: skip


def config(f: dict, replicas: int, rate: float, adapters: int | None = None, seed: int = 0) -> SimConfig:
    """The simulator as this box (x `replicas`), at `rate` over `adapters` (default: the run's)."""
    ranks = tuple(sorted(f["rank_pools"]))
    return SimConfig(
        replicas=replicas, adapters=adapters or f["adapters"], rate=rate, duration=SIM_S, warmup_s=SIM_WARMUP_S,
        rank_pools=dict(f["rank_pools"]), adapter_ranks=tuple(r for r in (8, 8, 8, 8, 8, 8, 16, 16, 16, 32) if r in ranks)
        or ranks, zipf_s=f["zipf_s"], prompt_tokens=f["prompt_tokens"], output_tokens=f["output_tokens"],
        max_request_tokens=2048, max_batch=32, decode_step_s=f["decode_step_s"],
        decode_step_per_row_s=f["decode_step_per_row_s"], prefill_tokens_per_s=f["prefill_tokens_per_s"],
        load_s=dict(f["load_s"]), ram_adapters=f["ram_adapters"], disk_adapters=max(f["ram_adapters"], adapters or f["adapters"]),
        adapter_bytes=f["adapter_bytes"], load_threshold_tokens=8192, seed=seed)  # fmt: skip


def study(src: Path, progress: bool = True) -> dict:
    """Fit, then simulate this box at each measured rate and on a finer grid (its predicted goodput),
    then the fleet of such boxes for the seed's 40 req/s at 5,000 adapters."""
    from tqdm import tqdm

    f = fit(src)
    rates = sorted(f["measured"])
    grid = sorted(set(rates) | {round(x * 0.25, 2) for x in range(1, int(4 * max(rates) * 2) + 1)})
    box = {}
    for r in tqdm(grid, desc="simulating this box", unit="rate", disable=not progress):
        res = simulate(config(f, 1, r))
        box[r] = {"p95_ttft_ms": 1000 * res.p95_ttft_s, "p50_ttft_ms": 1000 * res.p50_ttft_s,
                  "device_hit_rate": res.device_hit_rate}  # fmt: skip
    predicted = max((r for r in grid if box[r]["p95_ttft_ms"] < 1000 and all(
        box[q]["p95_ttft_ms"] < 1000 for q in grid if q <= r)), default=0.0)  # fmt: skip
    per_box = predicted or max(rates)
    fleet = {}
    n = max(1, math.ceil(SEED_RATE / per_box))
    with tqdm(desc="simulating fleets at 40 req/s", unit="run", disable=not progress) as bar:
        while n <= 4 * math.ceil(SEED_RATE / per_box) + 8:
            res = simulate(config(f, n, SEED_RATE, SEED_ADAPTERS))
            fleet[n] = {"p95_ttft_ms": 1000 * res.p95_ttft_s, "p50_ttft_ms": 1000 * res.p50_ttft_s,
                        "device_hit_rate": res.device_hit_rate}  # fmt: skip
            bar.update(1)
            if fleet[n]["p95_ttft_ms"] < 1000:
                break
            n += max(1, n // 8)
    boxes = min((k for k, v in fleet.items() if v["p95_ttft_ms"] < 1000), default=None)
    return {"fit": f, "box": box, "predicted_goodput": predicted, "fleet": fleet, "boxes": boxes,
            "config": {k: v for k, v in asdict(config(f, 1, 1.0)).items() if not callable(v)}}


def render(s: dict) -> str:
    f = s["fit"]
    mg, pg = f["measured_goodput"], s["predicted_goodput"]
    lines = [BEGIN, "", "## Recalibrated on the real model (issue 39): boxes for the seed's 40 req/s", "",
             "Fitted from `make loadtest-real`'s run of ours (SmolLM2-135M-Instruct, 2 threads, on this 2-core "
             "box; docs/loadtests.md): decode step "
             f"{1000 * f['decode_step_s']:.1f} ms + {1000 * f['decode_step_per_row_s']:.2f} ms per row, prefill "
             f"{f['prefill_tokens_per_s']:,.0f} prompt tokens/s (router and HTTP included), loads "
             + ", ".join(f"{t} {1000 * v:.0f} ms{'' if t in f['loads_measured'] else ' (seed figure: not seen)'}"
                         for t, v in f["load_s"].items() if t != "gpu")
             + f"; rank pools {f['rank_pools']} (the replica's own sizing), RAM tier {f['ram_adapters']:,} adapters "
             f"(4 GiB over the mean adapter of {f['adapter_bytes'] / 1e6:.2f} MB), {f['prompt_tokens']:.0f} prompt + "
             f"{f['output_tokens']:.0f} output tokens per request on average, Zipf({f['zipf_s']}) over "
             f"{f['adapters']:,} adapters. Method: loadtests/real_scale.py's docstring. Each simulation: "
             f"{SIM_S:.0f} simulated s, the first {SIM_WARMUP_S:.0f} s left out.", "",
             "### This box: simulated vs measured", "",
             "| rate req/s | measured p95 TTFT ms | simulated p95 TTFT ms | simulated / measured | measured SLO |",
             "| ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r, m in sorted(f["measured"].items()):
        sim = s["box"].get(r, {}).get("p95_ttft_ms", math.nan)
        lines.append(f"| {r:g} | {m['p95_ttft_ms']:.0f} | {sim:.0f} | {sim / m['p95_ttft_ms']:.2f} | "
                     f"{'met' if m['slo_met'] else 'missed'} |")
    factor = pg / mg if mg else math.nan
    knee = [r for r in f["knee_steps"] if r in s["box"]]
    p95f = statistics.median(s["box"][r]["p95_ttft_ms"] / f["measured"][r]["p95_ttft_ms"] for r in knee) if knee else math.nan
    lines += ["", f"Goodput of this box (p95 TTFT < 1 s): **measured {mg:g} req/s, simulated {pg:g} req/s**"
              + (f": validation factor (simulated / measured goodput) {factor:.2f} (the simulator's grid is 0.25 req/s)."
                 if mg else ": no goodput to compare (neither met the SLO at any rate of the sweep).")
              + f" Validation factor on p95 TTFT (simulated / measured, median over the steps before the knee, "
              f"{', '.join(f'{r:g}' for r in knee)} req/s): **{p95f:.2f}**.",
              "", "### Boxes of this kind for 40 req/s at 5,000 adapters", "",
              "| boxes | simulated p95 TTFT ms | p50 ms | device hit |", "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    for n, v in sorted(s["fleet"].items()):
        lines.append(f"| {n} | {v['p95_ttft_ms']:.0f} | {v['p50_ttft_ms']:.0f} | {100 * v['device_hit_rate']:.0f}% |")
    b = s["boxes"]
    floor = f["prompt_tokens"] / f["prefill_tokens_per_s"] + f["decode_step_s"]
    corrected = math.ceil(b * factor) if b and factor and not math.isnan(factor) else None
    lines += ["", (f"**{b} boxes of this kind** (2 CPU cores each, SmolLM2-135M) carry 40 req/s over 5,000 adapters "
                   f"at p95 TTFT < 1 s in the simulator" + (f"; scaled by the validation factor, about {corrected}" if corrected and corrected != b else "")
                   if b else "No fleet size the study tried met p95 < 1 s at 40 req/s"
                   + (f": with these service figures one request alone takes {floor:.2f} s to its first token "
                      f"(prefill of the mean prompt + one decode step), so no number of such boxes meets a 1 s p95"
                      if floor >= 1 else ""))
              + (f". By the measured goodput alone, 40 / {mg:g} = **{math.ceil(40 / mg)} boxes**, an upper bound on the "
                 f"count (the router's affinity gives each box ~1/{math.ceil(40 / mg)} of the adapters: more device hits than "
                 f"this box had with all 5,000); the simulated table is flat near 1 s because its p95 is set by the "
                 f"prefill of the longest prompts, not by the load per box" if mg else "")
              + f", beside the seed's plan of {SEED_REPLICAS} GPU replicas of a 7B model (above). The two are not "
              "the same workload: a 135M model on 2 CPU cores against a 7B model on one GPU each; what carries over "
              "is the method (the simulator calibrated on a measured box, checked against that box's sweep).", "", END]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_docs(src: Path, to: Path, progress: bool = True) -> Path:
    from loadtests.real_report import splice

    md = to / "scale.md"
    s = study(src, progress)
    (to / "loadtests").mkdir(parents=True, exist_ok=True)
    (to / "loadtests" / "real_scale.json").write_text(json.dumps(s, indent=1, default=str) + "\n")
    md.write_text(splice(md.read_text() if md.exists() else "# Fleet scale\n", render(s), BEGIN, END))
    return md
