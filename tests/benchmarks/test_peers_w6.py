"""W6, the Zipf mix, without starting a server: the seeded sequence, its flags, 1,000 adapters
through the GGUF converter's batch, what vLLM and llama-server are told about them, and how the
report shows a second phase."""

from __future__ import annotations

import csv
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.peers import report, run, servers
from benchmarks.peers.convert import convert_adapters
from benchmarks.peers.install import Installed
from benchmarks.peers.workloads import zipf_sequence
from lorafarm.errors import CliError


def test_zipf_sequence_is_seeded_and_follows_the_law():
    names = [f"a{k}" for k in range(1000)]
    draws = zipf_sequence(names, 20_000, seed=7)
    assert draws == zipf_sequence(names, 20_000, seed=7)  # every server of a round meets the same one
    assert draws != zipf_sequence(names, 20_000, seed=8)
    assert len(draws) == 20_000 and set(draws) <= set(names)
    counts = Counter(draws)
    assert counts.most_common(1)[0][0] == "a0"  # rank 1: the set's first
    # P(rank k) = k^-1.1 / H: rank 1 about 2^1.1 = 2.14 times rank 2, and 1/H of all draws
    assert 1.9 < counts["a0"] / counts["a1"] < 2.4
    harmonic = sum(k ** -1.1 for k in range(1, 1001))
    assert abs(counts["a0"] / 20_000 - 1 / harmonic) < 0.01
    assert len(counts) > 500  # the long tail is drawn too


@pytest.fixture
def model(tmp_path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_w6_flags(model):
    w6 = run._args(["--model", str(model), "--workloads", "W6"]).workload_list[0]
    assert (w6.zipf_pool, w6.requests, w6.concurrency) == (1000, 64, 8)
    w1, w6 = run._args(["--model", str(model), "--workloads", "w1,W6", "--requests", "4", "--zipf-adapters", "20",
                        "--zipf-requests", "6"]).workload_list
    assert (w1.requests, w1.zipf_pool, w6.requests, w6.concurrency, w6.zipf_pool) == (4, 0, 6, 6, 20)
    assert "20 adapters" in w6.title
    (w6,) = run._args(["--model", str(model), "--workloads", "W6", "--requests", "5"]).workload_list
    assert w6.requests == 5  # --requests scales W6 too unless --zipf-requests says otherwise
    # W6 brings its own adapters: the main set may be empty
    assert run._args(["--model", str(model), "--workloads", "W6", "--adapters", "0"]).workload_list
    for bad in (["--zipf-adapters", "0"], ["--zipf-requests", "0"]):
        with pytest.raises(CliError):
            run._args(["--model", str(model), *bad])


# stands in for llama.cpp's convert_lora_to_gguf.py: writes the adapter's name to --outfile, or exits 1
FAKE_CONVERTER = """
import sys
args = sys.argv[1:]
adapter, out = args[-1], args[args.index("--outfile") + 1]
assert args[args.index("--base") + 1] and args[args.index("--outtype") + 1] == "f32"
if adapter.endswith("bad"):
    sys.exit(1)
print("converted", adapter)  # the real script's chatter must not count as progress
open(out, "w").write(adapter)
"""


def test_converter_batch_writes_every_file_once(tmp_path):
    script = tmp_path / "src" / "vendor" / "llama.cpp" / "convert_lora_to_gguf.py"
    script.parent.mkdir(parents=True)
    script.write_text(FAKE_CONVERTER)
    adapters = [tmp_path / "a" / f"synth-{i:05d}" for i in range(1000)]
    out = tmp_path / "gguf"
    got = convert_adapters(tmp_path, adapters, out, tmp_path / "src", Path(sys.executable), progress=False)
    assert list(got) == [a.name for a in adapters]
    assert all(got[a.name].read_text() == str(a.resolve()) for a in adapters)
    assert not list(out.glob("*.part"))
    assert convert_adapters(tmp_path, adapters, out, tmp_path / "src", Path(sys.executable), progress=False) == got
    log = (out / "convert.log").read_text()
    assert log.count("$ ") == 1  # nothing left to convert: no second process
    assert log.count("converted ") == 1000  # the script's own output went to the log, not the progress pipe
    with pytest.raises(CliError, match="bad-f32.gguf"):
        convert_adapters(tmp_path, [tmp_path / "a" / "bad"], out, tmp_path / "src", Path(sys.executable), progress=False)


def _installed(peer: str) -> Installed:
    return Installed(peer, "1", "/opt/peer/bin/server", "test")


def test_llamacpp_loads_1000_adapters_and_lists_every_scale(tmp_path):
    names = [f"synth-{i:05d}" for i in range(1000)]
    loras = {n: Path(f"/g/{n}-f32.gguf") for n in names}
    s = servers.llamacpp(_installed("llamacpp"), Path("/g/base.gguf"), loras, tmp_path, 1)
    chunks = [s.command[i + 1] for i, a in enumerate(s.command) if a == "--lora"]
    assert len(chunks) == 5 and all(len(c) < 128 * 1024 for c in chunks)  # Linux's limit per argument
    assert ",".join(chunks).split(",") == [str(p) for p in loras.values()]  # ids in this order
    model, body = s.request("synth-00007")
    assert model == "base" and [e["id"] for e in body["lora"]] == list(range(1000))
    assert [e["id"] for e in body["lora"] if e["scale"] == 1.0] == [7] and sum(e["scale"] for e in body["lora"]) == 1
    assert all(e["scale"] == 0.0 for e in s.request(None)[1]["lora"])
    assert s.request("synth-00008")[1]["lora"][7]["scale"] == 0.0  # one adapter's list is not another's
    shown = report.short_command(s.describe()["command"])
    assert len(shown) < 1000 and shown.count("(200 adapters)") == 5


def test_vllm_w6_sizes(tmp_path):
    adapters = [tmp_path / f"synth-{i:05d}" for i in range(3)]
    main = servers.vllm(_installed("vllm"), tmp_path, adapters, tmp_path, 1).command
    assert main[main.index("--max-loras") + 1] == "3" and "--max-cpu-loras" not in main
    w6 = servers.vllm(_installed("vllm"), tmp_path, adapters, tmp_path, 1, rank=8, max_loras=32, cpu_loras=3).command
    assert [w6[w6.index(f) + 1] for f in ("--max-loras", "--max-lora-rank", "--max-cpu-loras")] == ["32", "8", "3"]
    assert f"synth-00002={adapters[2].resolve()}" in w6


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_report_shows_w6_beside_the_first_phase(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    server = {"version": "1", "how": "test", "threads": 1, "env": {}, "startup_s": 1.0}
    meta = {"command": "python -m benchmarks.peers.run", "model": "/m/smollm2", "adapters": ["synth-00000"],
            "rounds": 1, "threads": 1, "max_tokens": 64, "cpus": 2, "platform": "linux", "load_at_start": [0.5],
            "workloads": [{"name": "W1", "title": "base, 32 concurrent", "requests": 1},
                          {"name": "W6", "title": "Zipf 1.1 over 20 adapters, 8 concurrent", "requests": 2}],
            "servers": [{**server, "peer": "ours", "command": "lorafarm up", "workloads": ["W1"]},
                        {**server, "peer": "llamacpp", "command": "llama-server", "workloads": ["W1"]},
                        {**server, "peer": "ours", "command": "lorafarm up", "workloads": ["W6"]}],
            "skipped": [{"peer": "llamacpp", "workload": "W6", "why": "test"}],
            "zipf": {"adapters": 20, "rank": 8, "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"],
                     "exponent": 1.1, "device_slots": 32, "adapter_bytes": 3_717_656, "total_bytes": 20 * 3_717_656}}
    (results / "meta.json").write_text(json.dumps(meta))
    batch = {"round": 1, "failed": 0, "requests": 1, "tokens_per_s": 10.0}
    _write(results / "batches.csv", [{**batch, "peer": "ours", "workload": "W1"},
                                     {**batch, "peer": "llamacpp", "workload": "W1", "tokens_per_s": 5.0},
                                     {**batch, "peer": "ours", "workload": "W6", "tokens_per_s": 8.0}])
    req = {"ok": "True", "ttft_s": 0.1, "total_s": 1.0, "completion_tokens": 10}
    _write(results / "requests.csv", [{**req, "peer": "ours", "workload": "W1"}, {**req, "peer": "ours", "workload": "W6"},
                                      {**req, "peer": "llamacpp", "workload": "W1"}])
    _write(results / "rounds.csv", [{"round": 1, "workloads": "W1", "order": "ours llamacpp", "load1": 1, "load1_end": 1,
                                     "wall_s": 1}, {"round": 1, "workloads": "W6", "order": "ours", "load1": 1,
                                                    "load1_end": 1, "wall_s": 1}])
    assert report.main(["--from", str(results), "--to", str(tmp_path / "docs")]) == 0
    md = (tmp_path / "docs" / "peers.md").read_text()
    lines = md.splitlines()
    head = next(ln for ln in lines if ln.startswith("| workload |"))
    assert head.count("ours tok/s") == 1 and head.count("llama.cpp tok/s") == 1  # one column per peer
    w6 = next(ln for ln in lines if ln.startswith("| W6 "))
    assert "| 8.0 | n/a: test |" in w6  # why it did not run, in its row
    assert "20 random rank-8 PEFT adapters on k_proj, o_proj, q_proj, v_proj" in md
    assert "3.7 MB each" in md and "0.07 GB in all" in md
    assert "ours (W6):" in md and "| 1 | W6 | ours |" in md
