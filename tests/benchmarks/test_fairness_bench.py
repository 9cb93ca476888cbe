"""`make bench-fairness`'s machinery (benchmarks/fairness.py) on the dev model with tiny phases: two
real replicas (fair, fifo), the attacker in its own process, every attack, the tenant-alone rounds;
then the renderer. Checks the shape of the results and that the document and its plots are written;
never a figure (a second of each phase on a shared box measures nothing)."""

from __future__ import annotations

import json

import pytest

from benchmarks import fairness

pytestmark = pytest.mark.timeout(600)


def test_the_fairness_benchmark_runs_and_renders(dev_model, tmp_path):
    out, docs = tmp_path / "results", tmp_path / "docs"
    rc = fairness.main(["--models", "dev", "--dev-base", str(dev_model), "--out", str(out),
                        "--baseline-s", "1", "--attack-s", "1.5", "--warm-s", "0.5", "--tail-s", "0.5",
                        "--alone-s", "1", "--alone-rounds", "1", "--alone-warmup-s", "0",
                        "--n16-max-tokens", "32", "--flood", "24",
                        "--settle-timeout-s", "60", "--no-progress"])
    assert rc == 0
    res = json.loads((out / "dev.json").read_text())
    assert res["model"] == "dev" and res["model_name"] == "dev-tiny"
    assert len(res["loadavg_before"]) == 3 and res["started"] and res["command"].startswith("python -m benchmarks")
    assert [a["id"] for a in res["attacks"]] == ["1", "2", "3", "4", "1-fifo"]
    for a in res["attacks"]:
        assert a["replica_alive"], a["id"]
        assert [p["name"] for p in a["phases"]] == ["baseline", "attack warm-up", "attack", "attacker alone"]
        for phase in ("victim_baseline", "victim_attack"):
            v = a[phase]
            assert v["n"] >= 1 and {"p50", "p95", "statuses", "refused_429", "ok"} <= set(v), (a["id"], v)
        assert {"gen_tokens_per_s", "answered_per_s", "statuses", "refused_429"} <= set(a["attacker_attack"])
        assert "p95_ratio" in a and isinstance(a["target_met"], bool)
        assert a["metrics"] and a["victim_requests"]
        assert ("--scheduling", "fifo" if a["id"] == "1-fifo" else "fair") == tuple(
            a["replica_flags"][a["replica_flags"].index("--scheduling"):][:2])
    by_id = {a["id"]: a for a in res["attacks"]}
    assert by_id["1"]["attacker_requests"] or by_id["1"]["metrics"][-1][1].get("attacker")  # the attacker ran
    assert any(r[2] == 400 for r in by_id["2"]["attacker_requests"])  # huge prompts: refused past the context
    assert any(r[2] in (400, 429) for r in by_id["3"]["attacker_requests"])  # the flood: refused or 429
    assert [(r["scheduling"], r["round"]) for r in res["alone"]["rounds"]] == [("fair", 1), ("fifo", 1)]
    assert {"fair_tokens_per_s", "fifo_tokens_per_s", "ratio", "target_met"} <= set(res["alone"])

    rc = fairness.main(["--report-from", str(out), "--to", str(docs)])
    assert rc == 0
    md = (docs / "fairness.md").read_text()
    assert "## dev model: dev-tiny" in md and "no router" in md
    assert md.count("\n| 1") >= 2 and "| 1-fifo:" in md and "Tenant alone" in md
    for aid in ("1", "2", "3", "4", "1-fifo"):
        png = docs / "fairness" / f"dev-attack{aid}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(fairness/dev-attack{aid}.png)" in md


def test_the_report_refuses_an_empty_folder(tmp_path):
    with pytest.raises(SystemExit, match="no results"):
        fairness.main(["--report-from", str(tmp_path), "--to", str(tmp_path / "docs")])
