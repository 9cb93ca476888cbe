"""The peers harness end to end on the tiny dev model so it does not rot: ours (`lorafarm up`, two
adapters uploaded through the registry) and `transformers serve` (the peer that installs quickly:
our venv's, whose dev extra carries its serving deps; else the harness installs it with pip and a
failure fails the test) through run.py's own code path, then report.py renders docs from the CSVs.
W6's phase runs on ours alone: its own adapters registered through the registry once the farm is up."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from benchmarks.peers import report, run
from benchmarks.peers.workloads import zipf_sequence


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_peers_run_and_report(dev_model, tmp_path, capsys):
    out = tmp_path / "results"
    rc = run.main(["--model", str(dev_model), "--adapters", "2", "--rounds", "1", "--peers", "ours,transformers",
                   "--workloads", "W1,W2", "--requests", "2", "--max-tokens", "16", "--agree-prompts", "1",
                   "--threads", "1", "--root", str(tmp_path / "peers"), "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err[-3000:]

    reqs = _rows(out / "requests.csv")
    got = sorted((r["peer"], r["workload"]) for r in reqs)
    assert got == [("ours", "W1"), ("ours", "W1"), ("ours", "W2"), ("ours", "W2"),
                   ("transformers", "W1"), ("transformers", "W1")]  # no per-request LoRA in transformers serve
    for r in reqs:
        assert r["ok"] == "True", r
        assert 0 < int(r["completion_tokens"]) <= 16
        assert 0 < float(r["ttft_s"]) <= float(r["total_s"])
    assert {r["adapter"] for r in reqs if r["workload"] == "W2"} == {"synth-00000", "synth-00001"}
    assert {r["adapter"] for r in reqs if r["workload"] == "W1"} == {""}

    batches = _rows(out / "batches.csv")
    assert len(batches) == 3
    for b in batches:
        mine = [r for r in reqs if (r["peer"], r["workload"]) == (b["peer"], b["workload"])]
        assert int(b["completion_tokens"]) == sum(int(r["completion_tokens"]) for r in mine)
        assert float(b["tokens_per_s"]) > 0 and b["failed"] == "0"
    (rnd,) = _rows(out / "rounds.csv")
    assert sorted(rnd["order"].split()) == ["ours", "transformers"] and float(rnd["load1"]) >= 0

    meta = json.loads((out / "meta.json").read_text())
    assert {s["peer"] for s in meta["servers"]} == {"ours", "transformers"}
    assert all(s["version"] and s["threads"] == 1 and s["command"] for s in meta["servers"])
    assert {(k["peer"], k["workload"]) for k in meta["skipped"]} == {("transformers", "W2")}
    agree = _rows(out / "agreement.csv")
    assert {(a["model"], a["peer"]) for a in agree} == {("base", "ours"), ("base", "transformers"),
                                                         ("synth-00000", "ours"), ("synth-00001", "ours")}
    assert all(a["ok"] == "True" and a["text"] for a in agree)

    docs = tmp_path / "docs"
    assert report.main(["--from", str(out), "--to", str(docs)]) == 0
    md = (docs / "peers.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| W1 ") or ln.startswith("| workload |")]
    assert len(table) == 2 and "ours/transformers serve" in table[0]
    assert table[1].count("x |") == 1  # the ours/transformers ratio
    assert "| n/a: no per-request LoRA |" in next(ln for ln in md.splitlines() if ln.startswith("| W2 "))
    assert (docs / "peers" / "throughput.png").stat().st_size > 0 and (docs / "peers" / "ttft.png").exists()


def test_peers_w6_through_our_registry(dev_model, tmp_path, capsys):
    out = tmp_path / "results"
    rc = run.main(["--model", str(dev_model), "--rounds", "1", "--peers", "ours,transformers", "--workloads", "W6",
                   "--zipf-adapters", "5", "--zipf-requests", "4", "--max-tokens", "8", "--threads", "1",
                   "--root", str(tmp_path / "peers"), "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err[-3000:]

    reqs = _rows(out / "requests.csv")
    assert all(r["ok"] == "True" and (r["peer"], r["workload"]) == ("ours", "W6") for r in reqs), reqs
    # round 1 of seed 0: the sequence every server of that round meets
    assert [r["adapter"] for r in reqs] == zipf_sequence([f"synth-{i:05d}" for i in range(5)], 4, seed=1)
    meta = json.loads((out / "meta.json").read_text())
    (ours,) = meta["servers"]  # transformers serve has no per-request LoRA: not started
    assert ours["workloads"] == ["W6"] and "--adapters" not in ours["command"]  # registered after start-up
    assert {(k["peer"], k["workload"]) for k in meta["skipped"]} == {("transformers", "W6")}
    z = meta["zipf"]
    assert (z["adapters"], z["rank"], z["target_modules"]) == (5, 8, ["k_proj", "o_proj", "q_proj", "v_proj"])
    assert z["total_bytes"] == 5 * z["adapter_bytes"] > 0
    (rnd,) = _rows(out / "rounds.csv")
    assert (rnd["workloads"], rnd["order"]) == ("W6", "ours")

    docs = tmp_path / "docs"
    assert report.main(["--from", str(out), "--to", str(docs)]) == 0
    w6 = next(ln for ln in (docs / "peers.md").read_text().splitlines() if ln.startswith("| W6 "))
    assert "Zipf 1.1 over 5 adapters" in w6 and "| n/a: no per-request LoRA |" in w6  # transformers' column


def test_bad_input_is_one_line(dev_model, tmp_path, capsys):
    assert run.main(["--model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert run.main(["--model", str(dev_model), "--peers", "ours,nope", "--out", str(tmp_path / "o")]) == 2
    assert report.main(["--from", str(tmp_path), "--to", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("peers ") for line in err)
