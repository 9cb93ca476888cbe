"""Tables and one PNG for issue 13's end-to-end figures, from the raw per-request CSVs of
`lorafarm loadtest` (loadtests.runner.summarize: the same percentiles as the load-test report).

    python benchmarks/cold_path_e2e_report.py --score var/e2e-score4 var/e2e-score4b \
        --cold var/e2e-cold var/e2e-cold2 --png docs/cold_path_e2e.png

--score: `lorafarm loadtest --ab --ab-routings affinity,class-order` results folders (their
steps/ab-<routing>-requests.csv); --cold: benchmarks/cold_path_e2e.sh's folders (before/, after/,
each one `--farm` sweep step). Each folder's figures, then (several folders) the requests of all
runs pooled per variant; the PNG draws the pooled ones. Prints markdown: per variant and tier, requests, TTFT p50/p95 (ms),
the share of requests served from a device slot, and the replicas' device-hit rate where scraped.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from loadtests.runner import TIERS, read_requests, summarize

TIER_ORDER = ["all", *TIERS]


def _variant(requests_csvs: list[Path], window_s: float, rows: list[dict]) -> dict:
    """One variant over one or more runs: their measured requests pooled (window: the sum)."""
    requests = [r for p in requests_csvs for r in read_requests(p)]
    groups = {g["group"]: g for g in summarize(requests, window_s * len(requests_csvs))}
    hits = [float(r["device_hit_rate"]) for r in rows if r and r.get("device_hit_rate") not in (None, "")]
    rate = next((float(r["rate"]) for r in rows if r), math.nan)
    return {"groups": groups, "device_hit_rate": sum(hits) / len(hits) if hits else math.nan, "rate": rate}


def _csv_row(path: Path, run: str, group: str = "all") -> dict | None:
    import csv

    if not path.exists():
        return None
    with path.open() as f:
        return next((r for r in csv.DictReader(f) if r["run"] == run and r["group"] == group), None)


def _score_runs(d: Path) -> dict[str, tuple[Path, float, dict | None]]:
    duration = json.loads((d / "meta.json").read_text())["duration"]
    out = {}
    for routing, label in (("affinity", "expected-ttft"), ("class-order", "class-order")):
        csv_path = d / "steps" / f"ab-{routing}-requests.csv"
        if csv_path.exists():
            out[label] = (csv_path, duration, _csv_row(d / "ab.csv", f"ab-{routing}"))
    return out


def _cold_runs(d: Path) -> dict[str, tuple[Path, float, dict | None]]:
    out = {}
    for name in ("before", "after"):
        if (d / name / "meta.json").exists():
            duration = json.loads((d / name / "meta.json").read_text())["duration"]
            csv_path = next((d / name / "steps").glob("sweep-*-requests.csv"))
            out[name] = (csv_path, duration, _csv_row(d / name / "sweep.csv", "sweep"))
    return out


def load(dirs: list[Path], runs_of) -> dict[str, dict]:
    """{variant: summary} per run folder ("name (DIR)") and, with several folders, pooled ("name, pooled")."""
    per_dir = [(d, runs_of(d)) for d in dirs]
    out: dict[str, dict] = {}
    for d, runs in per_dir:
        for name, (csv_path, duration, row) in runs.items():
            out[f"{name} ({d.name})"] = _variant([csv_path], duration, [row])
    if len(dirs) > 1:
        for name in dict.fromkeys(n for _, runs in per_dir for n in runs):
            got = [runs[name] for _, runs in per_dir if name in runs]
            out[f"{name}, {len(got)} runs pooled"] = _variant([g[0] for g in got], got[0][1], [g[2] for g in got])
    return out


def _ms(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.0f}"


def table(variants: dict[str, dict]) -> str:
    lines = ["| variant | tier | requests | errors | TTFT p50 | TTFT p95 | TTFT p99 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, v in variants.items():
        for tier in TIER_ORDER:
            g = v["groups"].get(tier)
            if g is None:
                continue
            lines.append(f"| {name} | {tier} | {g['requests']} | {g['errors']} | {_ms(g['ttft_p50_ms'])} | "
                         f"{_ms(g['ttft_p95_ms'])} | {_ms(g['ttft_p99_ms'])} |")  # fmt: skip
    lines += ["", "| variant | requests from a device slot | replicas' device hit rate (scraped) |", "| --- | ---: | ---: |"]
    for name, v in variants.items():
        n = v["groups"]["all"]["requests"]
        gpu = v["groups"].get("gpu", {}).get("requests", 0)
        hit = v["device_hit_rate"]
        lines.append(f"| {name} | {gpu}/{n} ({100 * gpu / max(n, 1):.1f}%) | "
                     + ("-" if math.isnan(hit) else f"{100 * hit:.1f}%") + " |")
    return "\n".join(lines)


def plot(data: dict[str, dict[str, dict]], png: Path) -> None:
    """p95 TTFT per tier, one panel per comparison; pooled variants where there are several runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in (("cold", "before vs after the cold-path change"),
                                  ("score", "expected-TTFT vs class-order routing")) if data.get(k)]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        variants = data[key]
        pooled = {k: v for k, v in variants.items() if "pooled" in k}
        variants = pooled or variants
        tiers = [t for t in TIER_ORDER if any(t in v["groups"] for v in variants.values())]
        width = 0.8 / len(variants)
        for i, (name, v) in enumerate(variants.items()):
            ys = [v["groups"][t]["ttft_p95_ms"] if t in v["groups"] else 0.0 for t in tiers]
            xs = [j + i * width for j in range(len(tiers))]
            bars = ax.bar(xs, ys, width, label=name)
            for b, t in zip(bars, tiers):
                if t in v["groups"]:
                    ax.annotate(f"n={v['groups'][t]['requests']}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(tiers))], tiers)
        ax.set_ylabel("p95 TTFT (ms)")
        ax.set_ylim(0, 1.25 * max(g["ttft_p95_ms"] for v in variants.values() for g in v["groups"].values()))
        ax.set_title(f"{title}, {next(iter(variants.values()))['rate']:g} req/s", fontsize=10)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--score", type=Path, nargs="*", default=[], help="loadtest --ab results folders (pooled)")
    p.add_argument("--cold", type=Path, nargs="*", default=[], help="cold_path_e2e.sh folders (pooled)")
    p.add_argument("--png", type=Path, default=None)
    a = p.parse_args()
    data = {k: load(dirs, runs_of) for k, dirs, runs_of in (("cold", a.cold, _cold_runs), ("score", a.score, _score_runs))
            if dirs}  # fmt: skip
    for key, variants in data.items():
        print(f"## {key}\n\n{table(variants)}\n")
    if a.png:
        plot(data, a.png)
        print(a.png)


if __name__ == "__main__":
    main()
