"""`lorafarm loadtest` end to end through real processes: a farm (registry, router, two replicas),
20 synthetic adapters uploaded with `lorafarm adapters synth`, the locust suite headless at a low
rate; then bad input (one line, exit 2) and Ctrl-C (partial CSV kept, every child process gone)."""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lorafarm.cli import main
from lorafarm.farm import Farm, FarmPorts
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _lorafarm(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorafarm", *args], capture_output=True, text=True, env=ENV,
                          timeout=kw.pop("timeout", 300), **kw)  # fmt: skip


@pytest.fixture(scope="module")
def synth_farm(tmp_path_factory, dev_model):
    state = tmp_path_factory.mktemp("ltfarm")
    farm = Farm(state, replicas=2, ports=FarmPorts.free(2), progress=False, demo_adapters=0)
    shutil.copytree(dev_model, farm.model_dir)
    try:
        farm.up()
        out = _lorafarm("adapters", "synth", "--count", "20", "--tenant", "smoke", "--aliases",
                        "--farm", str(farm.farm_json))  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert re.search(r"20 adapters \(20 new\) in .* adapters/s.*registry rows: 20 adapters \(20 of tenant smoke\), "
                         r"20 aliases", out.stdout), out.stdout  # fmt: skip
        key = re.search(r"API key \(shown only now\): (\S+)", out.stderr).group(1)
        yield {"farm": farm, "key": key}
    finally:
        farm.stop()


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _interrupt_when(proc: subprocess.Popen, ready, timeout: float = 240.0) -> set[int]:
    def reached() -> bool:
        if ready():
            return True
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        return False

    wait_for(reached, timeout, interval=0.2, what="the run reaching the point to interrupt")
    started = _descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    return started


def _sigint_default() -> None:
    """In the child before exec: SIGINT back to its default disposition. A run started in the
    background (`make test &`, nohup, CI runners) inherits SIGINT *ignored*, and Python then installs
    no KeyboardInterrupt handler, so the Ctrl-C below would do nothing (issue 26)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_the_partial_csv_and_stops_every_process(tmp_path, dev_model):
    """Ctrl-C (SIGINT) mid-sweep keeps what was measured and stops every child process. The child
    starts with SIGINT restored to its default (`_sigint_default`), so the test holds even when
    pytest itself runs with SIGINT ignored (a background launch)."""
    state = tmp_path / "state"
    shutil.copytree(dev_model, state / "models" / "lorafarm-dev-tiny")
    out = tmp_path / "lt"
    proc = subprocess.Popen([sys.executable, "-m", "lorafarm", "loadtest", "--replicas", "1", "--adapters", "3",
                             "--state-dir", str(state), "--rates", "1,2", "--duration", "4", "--warmup", "1",
                             "--out", str(out), "--quiet"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_sigint_default)  # fmt: skip
    started = _interrupt_when(proc, lambda: (out / "steps" / "slots8-2-requests.csv").exists())
    assert proc.returncode == 130
    assert len(started) >= 4  # registry, router, replica, locust
    assert not [p for p in started if _alive(p)]
    assert [(r["rate"], r["group"]) for r in _read(out / "sweep.csv")][0] == ("1.0", "all")  # step 1 kept
    assert {r["rate"] for r in _read(out / "sweep.csv")} == {"1.0"}  # step 2 was cut
    assert (out / "report.md").exists()


def _one_line_exit_2(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err
    return err


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert "every rate must be a positive number" in _one_line_exit_2(["loadtest", "--rates", "1,0"], capsys)
    assert "--adapters -5" in _one_line_exit_2(["loadtest", "--adapters", "-5"], capsys)
    assert "--duration" in _one_line_exit_2(["loadtest", "--duration", "0"], capsys)
    assert "--count -1" in _one_line_exit_2(["adapters", "synth", "--count", "-1", "--tenant", "t",
                                             "--registry-url", "http://127.0.0.1:9", "--admin-token", "x"], capsys)  # fmt: skip
    port = FarmPorts.free(1).router
    err = _one_line_exit_2(["loadtest", "--url", f"http://127.0.0.1:{port}", "--key", "k", "--out", str(tmp_path)], capsys)
    assert "cannot reach the router" in err
    assert "needs --key" in _one_line_exit_2(["loadtest", "--url", "http://127.0.0.1:1"], capsys)


def test_every_ab_routing_variant_is_a_valid_router_command_line(capsys):
    from loadtests.cli import ROUTING_ARGS
    from lorafarm.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["loadtest", "--ab"]).ab_routings == ["affinity", "random"]  # the default
    assert parser.parse_args(["loadtest", "--ab-routings", "affinity,class-order"]).ab_routings == ["affinity", "class-order"]
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["loadtest", "--ab", "--ab-routings", "affinity,fastest"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--ab-routings" in err and "class-order" in err and "\n" not in err
    scores = {v: parser.parse_args(["router", *args]).score for v, args in ROUTING_ARGS.items()}
    assert scores == {"affinity": "expected-ttft", "class-order": "class-order", "random": "expected-ttft"}


def test_wrong_key_is_one_line_and_exit_2(synth_farm, capsys, tmp_path):
    url = synth_farm["farm"].router_url
    err = _one_line_exit_2(["loadtest", "--url", url, "--key", "lf-wrong", "--out", str(tmp_path)], capsys)
    assert "rejected the API key" in err


def test_smoke_sweep_reports_tiers_and_no_errors(synth_farm, tmp_path):
    out = tmp_path / "lt"
    r = _lorafarm("loadtest", "--farm", str(synth_farm["farm"].farm_json), "--key", synth_farm["key"],
                  "--rates", "2", "--duration", "8", "--warmup", "2", "--out", str(out), "--quiet")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _read(out / "sweep.csv")
    groups = {row["group"]: row for row in rows}
    assert groups["all"]["errors"] == "0", groups["all"]["errors_by_kind"]
    assert int(groups["all"]["requests"]) >= 5
    tiers = set(groups) - {"all"}
    assert tiers and tiers <= {"gpu", "ram", "disk", "remote"}
    assert sum(int(groups[t]["requests"]) for t in tiers) == int(groups["all"]["requests"])
    assert float(groups["all"]["ttft_p95_ms"]) > 0
    assert 0 <= float(groups["all"]["device_hit_rate"]) <= 1  # from the replicas' /metrics
    report = (out / "report.md").read_text()
    assert "## Sweep `sweep`" in report and "Highest rate with p95 TTFT < 1 s" in report
    assert all((out / png).stat().st_size > 0 for png in ("ttft_p95_by_tier.png", "hit_rate.png", "ttft_cdf.png"))
    # locust's own stats split by tier: TTFT/E2E request types named by x-adapter-tier
    stats = _read(out / "steps" / "sweep-2-requests.csv")
    assert {s["phase"] for s in stats} <= {"warmup", "measure"}
    locust_rows = {(s["Type"], s["Name"]) for s in _read(out / "steps" / "sweep-2_stats.csv")}
    assert {("TTFT", t) for t in tiers} <= locust_rows and {("E2E", t) for t in tiers} <= locust_rows
