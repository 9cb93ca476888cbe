"""`make loadtest-real`'s harness, tiny, so it cannot rot: the dev model, 50 adapters (2 of them canaries),
two rates of a few seconds each, ours only, through real processes (`lorafarm up`: registry, router,
replica) and the official openai client; then the docs section rendered from what it wrote.

Nothing here is timed: the SLO verdicts are whatever this box gave; what is checked is that every
request of the seeded sequence was sent and answered, canaries answered their markers, and the
figures and the report are there."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

from loadtests.real import CANARY_RANKS, Fleet, workload
from loadtests.real_report import BEGIN, END, write_docs

REPO = Path(__file__).resolve().parents[2]
RATES = (2.0, 4.0)
WARMUP, WINDOW = 1.0, 4.0


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_real_loadtest_smoke(tmp_path, dev_model):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "loadtests.real", "run", "--model", str(dev_model), "--adapters", "50",
           "--canaries", "2", "--systems", "ours",
           "--rates", ",".join(map(str, RATES)), "--warmup", str(WARMUP), "--window", str(WINDOW), "--drain", "60",
           "--keep-going", "--quiet", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=900)  # under a minute on an idle 2-core box
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # it stops the farm it started (the farm runs in sessions of its own)
        _, err = proc.communicate(timeout=120)
        raise AssertionError(f"loadtests.real did not finish in 900 s:\n{err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]

    meta = json.loads((out / "meta.json").read_text())
    assert meta["adapters"] == 50 and sum(p.is_dir() for p in (out / "adapters").iterdir()) == 50
    names = meta["canaries"]
    assert sorted(c["popularity_rank"] for c in names.values()) == [r + 1 for r in CANARY_RANKS[:2]]
    assert [(s["system"], s["rate"]) for s in meta["steps"]] == [("ours", r) for r in RATES]
    assert "LORAFARM_PARALLEL_PRODUCTS" not in meta["servers"]["ours"]["env"]  # ours at its defaults

    # the seeded sequence, rebuilt here, is exactly what was sent
    order = sorted(p.name for p in (out / "adapters").iterdir() if p.name.startswith("synth-"))
    for n, c in sorted(names.items(), key=lambda kv: kv[1]["popularity_rank"]):
        order.insert(c["popularity_rank"] - 1, n)
    fleet = Fleet(out / "adapters", order, {n: c["marker"] for n, c in names.items()}, 0,
                  {n: c["prompt"] for n, c in names.items()})
    canary_requests = 0
    for k, rate in enumerate(RATES):
        want = workload(fleet, rate, WARMUP + WINDOW, k)
        rows = _rows(out / "requests" / f"ours-{rate:g}.csv")
        assert [(r["model"], int(r["max_tokens"])) for r in rows] == [(w.adapter or "base", w.max_tokens) for w in want]
        assert all(not r["error"] for r in rows), [r["error"] for r in rows if r["error"]]
        for r, w in zip(rows, want):
            assert int(r["output_tokens"]) == w.max_tokens or w.canary  # ignore_eos: the drawn length
            assert r["tier"] in ("gpu", "ram", "disk", "remote", "base")
            assert (r["tier"] == "base") == (w.adapter is None)
            if w.canary:
                assert r["marker_ok"] == "1", r
                canary_requests += r["phase"] == "measure"
    assert canary_requests > 0  # the seeded sequence draws canaries in the 4 req/s step

    steps = _rows(out / "steps.csv")
    top = {float(s["rate"]): s for s in steps if s["group"] == "all"}
    assert sorted(top) == list(RATES)
    for rate, s in top.items():
        assert int(s["errors"]) == 0 and int(s["wrong_markers"]) == 0
        assert float(s["sent_rate"]) == float(s["achieved_rate"]) > 0
        assert 0 <= float(s["device_hit_rate"]) <= 1 and float(s["cpu_busy"]) > 0
        assert s["slo_met"] == str(int(float(s["ttft_p95_ms"]) < 1000))
    assert sum(int(top[r]["canary_requests"]) for r in RATES) == canary_requests

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "loadtests.md").write_text("# Load test\n\nthe dev-model sweep\n")
    md = write_docs(out, docs)
    text = md.read_text()
    assert text.startswith("# Load test\n") and text.rstrip().endswith("the dev-model sweep")
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert "| ours |" in section and "### ours" in section
    for rate in RATES:
        assert f"\n| {rate:g} | " in section
    assert all((docs / "loadtests" / p).stat().st_size > 0 for p in ("real_ttft_p95.png", "real_hit_rate.png"))
    write_docs(out, docs)  # rendered again: replaced in place, not added twice
    assert md.read_text().count(BEGIN) == 1
