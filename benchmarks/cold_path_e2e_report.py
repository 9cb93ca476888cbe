"""Tables and one PNG for issue 13's end-to-end figures, from the raw per-request CSVs of
`lorafarm loadtest` (loadtests.runner.summarize: the same percentiles as the load-test report).

    python benchmarks/cold_path_e2e_report.py --score var/e2e-score --cold var/e2e-cold \
        --png docs/benchmarks/cold_path_e2e.png

--score: a `lorafarm loadtest --ab --ab-routings affinity,class-order` results folder (its
steps/ab-<routing>-requests.csv); --cold: benchmarks/cold_path_e2e.sh's folder (before/, after/,
each one `--farm` sweep step). Prints markdown: per variant and tier, requests, TTFT p50/p95 (ms),
the share of requests served from a device slot, and the replicas' device-hit rate where scraped.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from loadtests.runner import TIERS, read_requests, summarize

TIER_ORDER = ["all", *TIERS]


def _variant(requests_csv: Path, window_s: float, row: dict | None) -> dict:
    groups = {g["group"]: g for g in summarize(read_requests(requests_csv), window_s)}
    hit = float(row["device_hit_rate"]) if row and row.get("device_hit_rate") not in (None, "") else math.nan
    return {"groups": groups, "device_hit_rate": hit}


def _csv_row(path: Path, run: str, group: str = "all") -> dict | None:
    import csv

    if not path.exists():
        return None
    with path.open() as f:
        return next((r for r in csv.DictReader(f) if r["run"] == run and r["group"] == group), None)


def load(score: Path | None, cold: Path | None) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    if score:
        meta = json.loads((score / "meta.json").read_text())
        out["score"] = {}
        for routing, label in (("affinity", "expected-ttft"), ("class-order", "class-order")):
            csv_path = score / "steps" / f"ab-{routing}-requests.csv"
            if csv_path.exists():
                out["score"][label] = _variant(csv_path, meta["duration"], _csv_row(score / "ab.csv", f"ab-{routing}"))
    if cold:
        out["cold"] = {}
        for name in ("before", "after"):
            d = cold / name
            if not (d / "meta.json").exists():
                continue
            meta = json.loads((d / "meta.json").read_text())
            csv_path = next((d / "steps").glob("sweep-*-requests.csv"))
            out["cold"][name] = _variant(csv_path, meta["duration"], _csv_row(d / "sweep.csv", "sweep"))
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in (("cold", "before vs after the cold-path change"),
                                  ("score", "expected-TTFT vs class-order routing")) if data.get(k)]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        variants = data[key]
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
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--score", type=Path, default=None)
    p.add_argument("--cold", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    a = p.parse_args()
    data = load(a.score, a.cold)
    for key, variants in data.items():
        print(f"## {key}\n\n{table(variants)}\n")
    if a.png:
        plot(data, a.png)
        print(a.png)


if __name__ == "__main__":
    main()
