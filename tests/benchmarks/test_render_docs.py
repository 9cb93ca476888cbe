"""`make bench-docs` renders whatever the engine suite holds: entries with tokens/s and TTFT-only
ones (the prefix cache's), ratios from paired samples, into the generated block of benchmarks.md."""

from __future__ import annotations

import json

from benchmarks.conftest import GEN_END, GEN_START, render


def test_engine_suite_with_ttft_only_entries_renders(tmp_path):
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    docs.mkdir()
    (docs / "benchmarks.md").write_text(f"# Benchmarks\n\nkept\n\n{GEN_START}\nold\n{GEN_END}\n\ntail kept\n")
    res = {
        "prefix/ttft-cached-dev": {"ttft_s": 0.016, "median_s": 0.016, "rounds": 2, "samples": [0.016, 0.017]},
        "prefix/ttft-uncached-dev": {"ttft_s": 0.22, "median_s": 0.22, "rounds": 2, "samples": [0.2, 0.24]},
        "smallm/kernel-8": {"tokens_per_s": 80.0, "median_s": 0.1, "rounds": 2, "samples": [80.0, 82.0]},
        "smallm/mkl-8": {"tokens_per_s": 50.0, "median_s": 0.16, "rounds": 2, "samples": [50.0, 41.0]},
    }
    (results / "cpu-engine.json").write_text(json.dumps({"device": "cpu", "results": res, "environment": {}}))
    render(results, docs)
    md = (docs / "benchmarks.md").read_text()
    assert "kept" in md and "tail kept" in md and "old" not in md
    assert "| prefix/ttft-cached-dev | - | 0.016 |" in md
    assert "| smallm/kernel-8 | 80 | 0.100 |" in md
    # ratios of paired rounds: median(0.016/0.2, 0.017/0.24) and median(80/50, 82/41)
    ttft_row = next(ln for ln in md.splitlines() if ln.startswith("| prefix cache: TTFT") and "dev model" in ln)
    assert "| 0.075 | <= 0.2: met |" in ttft_row
    kernel_row = next(ln for ln in md.splitlines() if ln.startswith("| small-M kernel / MKL, 8 requests"))
    assert "| 1.800 | >= 1: met |" in kernel_row
