"""Write a load run's results as a markdown table and a TTFT plot (matplotlib, PNG)."""

from __future__ import annotations

from pathlib import Path

from loadtests.runner import Summary


def markdown(summary: Summary, title: str, command: str) -> str:
    lines = [
        f"## {title}",
        "",
        f"Command: `{command}`",
        "",
        f"{len(summary.results)} requests in {summary.wall:.1f} s, {summary.errors} errors, "
        f"{summary.output_tokens_per_s:.1f} output tokens/s.",
        "",
        "| group | requests | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | TPOT p95 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in summary.table():
        lines.append(
            f"| {row['group']} | {row['requests']} | {row['ttft_p50_ms']:.1f} | {row['ttft_p95_ms']:.1f} "
            f"| {row['tpot_p50_ms']:.1f} | {row['tpot_p95_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot_ttft(summaries: dict[str, Summary], out: Path) -> None:
    """TTFT CDF per run (e.g. affinity vs random routing), one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, summary in summaries.items():
        ttft = sorted(1000 * r.ttft for r in summary.results if r.ok and r.ttft is not None)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.95, color="grey", lw=0.5, ls="--")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
