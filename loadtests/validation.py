"""The simulator against a measured run: the stored figures of a real load test and the simulator
configured like that farm, with service times fitted from the same run.

Measured (docs/loadtest.md, `lorafarm loadtest --ab --duration 40 --rate 4`): 3 replicas of the tiny
dev model on this machine's CPU, 2 device slots in each rank pool (8/16/32/64), 16 canary adapters
(ranks cycling 8, 16, 32), Zipf(1.1) over the sorted aliases, Poisson 4 req/s for 40 s after a 10 s
warm-up pass, streamed through the router.

Fitted from that run (the figures below, not free parameters):
- decode step = TPOT p50 (6.2 ms);
- prefill: TTFT p50 of device hits (16.7 ms) minus one decode step leaves ~10.5 ms for a ~20-token
  chat prompt (template included) -> 2,000 prompt tokens/s, which also absorbs router + HTTP;
- loads: RAM ~ TTFT p50(ram) - TTFT p50(gpu) = 22.5 - 16.7 = 5.8 ms; disk 26.6 - 17.2 = 9.4 ms (the
  random run); remote (store -> disk -> RAM) ~ 30 ms (not observed in the run);
- output tokens: 22.9 tokens/s over 182 requests in 39.8 s = 5.0 per request (canaries stop after
  their marker), prompt ~20 tokens.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtests.simulate import SimConfig, SimResult, Simulation, simulate

SOURCE = "docs/loadtest.md (lorafarm loadtest --ab --duration 40 --rate 4)"
MEASURED = {
    "affinity": {"p50_ttft_s": 0.0171, "p95_ttft_s": 0.0329, "device_hit_rate": 0.934, "requests": 182},
    "random": {"p50_ttft_s": 0.0182, "p95_ttft_s": 0.0366, "device_hit_rate": 0.621, "requests": 182},
}


def fitted_config(routing: str, seed: int = 0) -> SimConfig:
    return SimConfig(
        replicas=3, adapters=16, rate=4.0, duration=50.0, warmup_s=10.0, routing=routing, seed=seed,
        rank_pools={8: 2, 16: 2, 32: 2, 64: 2}, adapter_ranks=(8, 16, 32), ram_adapters=16, disk_adapters=16,
        prompt_tokens=20.0, output_tokens=5.0, max_request_tokens=512, max_batch=32,
        decode_step_s=0.0062, prefill_tokens_per_s=2000.0,
        load_s={"gpu": 0.0, "ram": 0.0058, "disk": 0.0094, "remote": 0.030},
        load_threshold_tokens=8192, poll_s=1.0, stats_window_s=10.0, sample_s=5.0)


@dataclass(frozen=True)
class Comparison:
    routing: str
    simulated: dict
    measured: dict

    def factor(self, key: str) -> float:
        """simulated / measured."""
        return self.simulated[key] / self.measured[key]


def compare(routing: str, seeds: range = range(5)) -> Comparison:
    """Mean over a few seeds (one 40 s run is ~180 requests: its p95 is noisy)."""
    runs: list[SimResult] = [simulate(fitted_config(routing, seed)) for seed in seeds]
    keys = ("p50_ttft_s", "p95_ttft_s", "device_hit_rate")
    sim = {k: sum(getattr(r, k) for r in runs) / len(runs) for k in keys}
    sim["requests"] = sum(r.requests for r in runs) / len(runs)
    return Comparison(routing, sim, MEASURED[routing])


def markdown(comparisons: list[Comparison]) -> str:
    lines = ["## Validation: simulated vs measured", "",
             f"Measured: {SOURCE}. Simulated: the same farm (loadtests/validation.py), service times fitted "
             "from that run, mean of 5 seeds.", "",
             "| routing | quantity | measured | simulated | factor (sim / measured) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for c in comparisons:
        for key in ("p50_ttft_s", "p95_ttft_s", "device_hit_rate"):
            lines.append(f"| {c.routing} | {key} | {c.measured[key]:.4f} | {c.simulated[key]:.4f} | "
                         f"{c.factor(key):.2f} |")
    return "\n".join(lines) + "\n"




# --- Validation against the at-scale run (issue 11: docs/loadtests.md, raw CSVs in docs/loadtests/) ---
#
# Measured (`make loadtest-docs` = `lorafarm loadtest --replicas 2 --adapters 1000 --slots 32,2 --rates
# 0.5,1,2,4 --duration 30 --warmup 8`): 2 replicas of the tiny dev model on a 2-core CPU box shared with
# seven other engineers' jobs (CPU 94-100% busy in every step), 1,000 synthetic adapters of ranks 8/16/32
# cycling, rank pools 8/16/32/64 with 32 (then 2) device slots each, Zipf(1.1), Poisson arrivals, each
# step 8 s of warm-up then 30 s measured, the steps of one sweep in a row on the same farm (its slots stay
# warm from step to step; a fresh farm per sweep), the same seeded requests in both sweeps. RAM tier 4 GiB
# holds all 465 MB: RAM hit rate 100%, so every device miss is a RAM -> slot load.
#
# Fitted from the run's per-request CSVs (`fit_at_scale()`, the lowest-rate step of each sweep, where
# queueing is least; the figures below are its output, pinned):
# - decode step = TPOT p50 of the 0.5 req/s step;
# - prefill rate = mean prompt tokens / (TTFT p50 of device hits - one decode step) at 0.5 req/s;
# - RAM -> slot load = TTFT p50(ram tier) - TTFT p50(gpu tier), median over that sweep's four steps
#   (one step's difference is noise: 6-94 requests per tier), floored at 1 ms;
# - lengths: mean prompt tokens (chat template included) and mean output tokens of all measured requests.
# The two sweeps ran ~10 minutes apart on the same box under different contention, so each sweep gets
# its own fit (TPOT p50 at 0.5 req/s: 28.6 ms with 32 slots, 6.0 ms with 2 slots: same requests).

AT_SCALE_SOURCE = "docs/loadtests.md + docs/loadtests/ (issue 11, `make loadtest-docs`, 22:41 UTC)"
AT_SCALE_RATES = (0.5, 1.0, 2.0, 4.0)
AT_SCALE_WARMUP_S = 8.0
AT_SCALE_STEP_S = 30.0
# docs/loadtests/sweep.csv, group "all": (rate) -> requests, TTFT p50/p95 (s), device hit rate
AT_SCALE_MEASURED = {
    "slots32": {0.5: (15, 0.1776, 0.6280, 0.400), 1.0: (26, 0.1607, 0.3688, 0.692),
                2.0: (61, 0.0917, 0.3910, 0.590), 4.0: (122, 0.2324, 1.2364, 0.772)},
    "slots2": {0.5: (15, 0.0725, 0.1789, 0.467), 1.0: (26, 0.0545, 0.2583, 0.500),
               2.0: (61, 0.0674, 0.1979, 0.361), 4.0: (122, 0.1422, 0.5949, 0.369)},
}
AT_SCALE_SLOTS = {"slots32": 32, "slots2": 2}
# fit_at_scale() on docs/loadtests/steps/*-requests.csv (rounded)
AT_SCALE_FIT = {
    "slots32": {"decode_step_s": 0.0286, "prefill_tokens_per_s": 416.0, "ram_load_s": 0.0144},
    "slots2": {"decode_step_s": 0.0060, "prefill_tokens_per_s": 734.0, "ram_load_s": 0.0235},
}
AT_SCALE_PROMPT_TOKENS = 60.8
AT_SCALE_OUTPUT_TOKENS = 18.2


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else math.nan


def fit_at_scale(steps_dir: str | Path = "docs/loadtests/steps") -> dict:
    """Service times from the measured per-request CSVs (see the comment above for the rules)."""
    steps_dir = Path(steps_dir)
    rows = {}
    for run in AT_SCALE_SLOTS:
        for rate in AT_SCALE_RATES:
            with open(steps_dir / f"{run}-{rate:g}-requests.csv", newline="") as f:
                rows[run, rate] = [r for r in csv.DictReader(f) if r["phase"] == "measure" and r["status"] == "200"]
    allr = [r for rs in rows.values() for r in rs]
    fit = {"prompt_tokens": float(np.mean([float(r["prompt_tokens"]) for r in allr])),
           "output_tokens": float(np.mean([float(r["output_tokens"]) for r in allr]))}

    def tier_p50(rs, tier):
        return _median([float(r["ttft_s"]) for r in rs if r["tier"] == tier])

    for run in AT_SCALE_SLOTS:
        low = rows[run, AT_SCALE_RATES[0]]
        decode = _median([float(r["tpot_s"]) for r in low])
        prompt = float(np.mean([float(r["prompt_tokens"]) for r in low]))
        diffs = [tier_p50(rows[run, rate], "ram") - tier_p50(rows[run, rate], "gpu") for rate in AT_SCALE_RATES]
        fit[run] = {"decode_step_s": decode,
                    "prefill_tokens_per_s": prompt / max(1e-3, tier_p50(low, "gpu") - decode),
                    "ram_load_s": max(0.001, _median(diffs))}
    return fit


def at_scale_config(run: str, seed: int = 0) -> SimConfig:
    """One sweep as one simulation: the four steps in a row (warm-up + measured window each) on one
    farm, the rate stepped through a rate curve (thinning from the top rate)."""
    f = AT_SCALE_FIT[run]
    step = AT_SCALE_WARMUP_S + AT_SCALE_STEP_S
    top = max(AT_SCALE_RATES)
    slots = AT_SCALE_SLOTS[run]
    return SimConfig(
        replicas=2, adapters=1000, rate=top, duration=step * len(AT_SCALE_RATES), warmup_s=AT_SCALE_WARMUP_S,
        rate_curve=lambda t: AT_SCALE_RATES[min(len(AT_SCALE_RATES) - 1, int(t // step))] / top,
        routing="affinity", seed=seed, zipf_s=1.1,
        rank_pools={8: slots, 16: slots, 32: slots, 64: slots}, adapter_ranks=(8, 16, 32),
        ram_adapters=1000, disk_adapters=1000,
        prompt_tokens=AT_SCALE_PROMPT_TOKENS, output_tokens=AT_SCALE_OUTPUT_TOKENS, max_request_tokens=512,
        max_batch=32, decode_step_s=f["decode_step_s"], prefill_tokens_per_s=f["prefill_tokens_per_s"],
        load_s={"gpu": 0.0, "ram": f["ram_load_s"], "disk": 0.0094, "remote": 0.030},
        load_threshold_tokens=8192, poll_s=1.0, stats_window_s=10.0, sample_s=5.0)


@dataclass(frozen=True)
class StepComparison:
    run: str
    rate: float
    simulated: dict  # requests, p50_ttft_s, p95_ttft_s, device_hit_rate (mean over seeds)
    measured: dict

    def factor(self, key: str) -> float:
        """simulated / measured."""
        return self.simulated[key] / self.measured[key]


AT_SCALE_KEYS = ("p50_ttft_s", "p95_ttft_s", "device_hit_rate")


def compare_at_scale(run: str, seeds: range = range(4)) -> list[StepComparison]:
    """Per step, the mean over seeds of the simulated p50/p95 TTFT and device hit rate of requests
    arriving in that step's measured window (30 s: 15-122 requests, so one seed's p95 is noisy)."""
    step = AT_SCALE_WARMUP_S + AT_SCALE_STEP_S
    per = {rate: defaultdict(list) for rate in AT_SCALE_RATES}
    for seed in seeds:
        sim = Simulation(at_scale_config(run, seed))
        sim.run()
        for i, rate in enumerate(AT_SCALE_RATES):
            lo, hi = i * step + AT_SCALE_WARMUP_S, (i + 1) * step
            rs = [r for r in sim.done if lo <= r.arrival < hi]
            ttft = np.array([r.ttft for r in rs])
            per[rate]["requests"].append(len(rs))
            per[rate]["p50_ttft_s"].append(float(np.percentile(ttft, 50)))
            per[rate]["p95_ttft_s"].append(float(np.percentile(ttft, 95)))
            per[rate]["device_hit_rate"].append(sum(r.tier == "gpu" for r in rs) / len(rs))
    out = []
    for rate in AT_SCALE_RATES:
        n, p50, p95, hit = AT_SCALE_MEASURED[run][rate]
        out.append(StepComparison(run, rate, {k: float(np.mean(v)) for k, v in per[rate].items()},
                                  {"requests": n, "p50_ttft_s": p50, "p95_ttft_s": p95, "device_hit_rate": hit}))
    return out


def markdown_at_scale(comparisons: list[StepComparison]) -> str:
    lines = ["| run | rate (req/s) | requests meas / sim | quantity | measured | simulated | factor (sim / measured) |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for c in comparisons:
        for key in AT_SCALE_KEYS:
            lines.append(f"| {c.run} | {c.rate:g} | {c.measured['requests']} / {c.simulated['requests']:.0f} | "
                         f"{key} | {c.measured[key]:.4f} | {c.simulated[key]:.4f} | {c.factor(key):.2f} |")
    return "\n".join(lines) + "\n"


def pooled_hit_rate(comparisons: list[StepComparison], side: str) -> float:
    """Device hit rate over a sweep's four steps, weighted by each step's requests."""
    rows = [getattr(c, side) for c in comparisons]
    return sum(r["device_hit_rate"] * r["requests"] for r in rows) / sum(r["requests"] for r in rows)


AT_SCALE_HEADING = "## Validation against the at-scale run"


def section_at_scale(sweeps: dict[str, list[StepComparison]]) -> str:
    pooled = {run: (pooled_hit_rate(cs, "measured"), pooled_hit_rate(cs, "simulated")) for run, cs in sweeps.items()}
    fits = "; ".join(f"{run}: decode step {f['decode_step_s'] * 1e3:.1f} ms, prefill {f['prefill_tokens_per_s']:.0f} "
                     f"tokens/s, RAM -> slot load {f['ram_load_s'] * 1e3:.1f} ms" for run, f in AT_SCALE_FIT.items())
    lines = [
        AT_SCALE_HEADING, "",
        f"Measured: {AT_SCALE_SOURCE}: 2 replicas of the tiny dev model, 1,000 synthetic adapters (ranks 8/16/32),",
        "rank pools 8/16/32/64 with 32 and then 2 device slots each, Zipf(1.1), Poisson at 0.5/1/2/4 req/s, 8 s",
        "warm-up + 30 s measured per step, the steps in a row on one farm, on a 2-core CPU box 94-100% busy",
        "with seven other engineers' jobs. Simulated: the same farm, workload and step sequence",
        "(`loadtests.validation.at_scale_config`, one simulation per sweep with the rate stepped), mean of 4",
        "seeds, requests arriving in each step's measured window.", "",
        f"Fitted from that run's per-request CSVs (`fit_at_scale()`, lowest-rate step): {fits}; prompt",
        f"{AT_SCALE_PROMPT_TOKENS:.1f} tokens, output {AT_SCALE_OUTPUT_TOKENS:.1f} tokens (means). Each sweep has its own "
        "fit: the same requests ran at TPOT p50 28.6 ms in the first sweep and 6.0 ms in the second.", "",
        markdown_at_scale([c for cs in sweeps.values() for c in cs]),
        "Device hit rate over each sweep's four steps (request-weighted): "
        + "; ".join(f"{run} measured {m:.3f}, simulated {s:.3f}, factor {s / m:.2f}" for run, (m, s) in pooled.items())
        + ".", "",
        "Reading it honestly:",
        "- Device hit rate: with 32 slots the factor is 0.85-1.11 from 1 req/s on (1.6 at 0.5 req/s, the first",
        "  step after a fresh farm, 6 hits in 15 requests: one request is 0.07 of that rate). With 2 slots the",
        "  simulator predicts fewer hits than measured at every step (factor 0.5-0.9, ~0.1 absolute over the",
        "  sweep, beyond the ~0.03 standard error of 224 requests). Not explained yet: the rank rule, the pool",
        "  sizes and the Zipf order are the same code; candidates are the measured hit counter (hits and misses",
        "  of the replica's acquire, which may count a request that waited on another's load as a hit) and the",
        "  real router's tie-breaking between the two owners. The thrash ordering (2 slots well below 32) holds.",
        "- TTFT: p50 within 0.88-1.30 at the lowest rate, where the fit was taken, but off by up to ~2x",
        "  elsewhere, both ways, and mostly not because of queueing the model misses: the box's contention",
        "  changed from minute to minute (the",
        "  measured TTFT p50 at 2 req/s is half the one at 0.5 req/s in the 32-slot sweep; TPOT p50 went",
        "  28.6 -> 9.8 ms). At 4 req/s the simulator's p95 is 0.54-0.64x the measured one: the real decode step",
        "  slows with more rows and with the other processes on 2 cores (32 slots: TPOT p95 118 ms at 4 req/s vs",
        "  the fitted 28.6 ms step), which the simulator's fixed step (`decode_step_per_row_s = 0`) does not model. The per-step samples",
        "  are small (15-122 requests), so p95 at 0.5-1 req/s is one or two requests.",
        "- So this run confirms the hit-rate model with enough slots and the thrash direction, and bounds the",
        "  TTFT levels only to ~2x; it is not a test of the seed's GPU service times (none measured here).", "",
        "tests/fleet/test_validation.py keeps this check with stated bounds: per step p50 TTFT factor 0.5-2.0",
        "and p95 0.4-2.0; the fitted lowest-rate p50 0.67-1.5; the 32-slot sweep's pooled hit-rate factor",
        "0.85-1.2 and each 32-slot step from 1 req/s 0.75-1.33; the 2-slot sweep's pooled factor 0.6-1.0 (the",
        "known under-prediction, pinned so a change shows); the 2-slot hit rate below the 32-slot one.", ""]
    return "\n".join(lines)


def write_section(doc: str | Path, section: str) -> None:
    """Put `section` into the markdown file: replace an existing at-scale section (up to the next
    "## " heading), else insert it after the "## Validation: simulated vs measured" section, else append."""
    doc = Path(doc)
    lines = doc.read_text().splitlines()

    def end_of(i: int) -> int:
        return next((j for j in range(i + 1, len(lines)) if lines[j].startswith("## ")), len(lines))

    if AT_SCALE_HEADING in lines:
        i = lines.index(AT_SCALE_HEADING)
        lo, hi = i, end_of(i)
    else:
        v = next((i for i, line in enumerate(lines) if line.startswith("## Validation: simulated vs measured")), None)
        lo = hi = end_of(v) if v is not None else len(lines)
    new = lines[:lo] + section.rstrip("\n").splitlines() + [""] + lines[hi:]
    doc.write_text("\n".join(new).rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="the simulator against measured load tests")
    ap.add_argument("--at-scale", metavar="DOC", help="write the at-scale validation section into DOC "
                    "(e.g. docs/scale.md) instead of printing both comparisons")
    args = ap.parse_args(argv)
    sweeps = {run: compare_at_scale(run) for run in AT_SCALE_SLOTS}
    if args.at_scale:
        write_section(args.at_scale, section_at_scale(sweeps))
        print(f"wrote {AT_SCALE_HEADING!r} into {args.at_scale}")
        return 0
    print(markdown([compare("affinity"), compare("random")]))
    print(section_at_scale(sweeps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
