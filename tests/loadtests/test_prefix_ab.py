"""`lorafarm loadtest --ab-prefix-cache` wiring (issue 24), without processes: the farm, the adapter
upload and locust are fakes, so what is checked is what the command asks of them (the replica flag
per variant, the same workload options) and what it makes of their output (sweep.csv, the report)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import loadtests.cli as lt_cli
import loadtests.runner as runner
import loadtests.synth as synth
import lorafarm.farm as farm_mod
from lorafarm.cli import main


def _one_line_exit_2(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err
    return err


def test_bad_prefix_ab_input_is_one_line_and_exit_2(capsys):
    ab = ["loadtest", "--ab-prefix-cache", "--system-prompt-share", "0.8"]
    assert "--system-prompt-share > 0" in _one_line_exit_2(["loadtest", "--ab-prefix-cache"], capsys)
    assert "drop --url/--farm" in _one_line_exit_2([*ab, "--url", "http://127.0.0.1:1", "--key", "k"], capsys)
    assert "one at a time" in _one_line_exit_2([*ab, "--ab"], capsys)
    assert "one --slots value" in _one_line_exit_2([*ab, "--slots", "8,2"], capsys)
    assert "--replica-arg" in _one_line_exit_2([*ab, "--replica-arg=--no-prefix-cache"], capsys)
    assert "within 0..1" in _one_line_exit_2(["loadtest", "--system-prompt-share", "1.5"], capsys)
    assert "cap" in _one_line_exit_2(["loadtest", "--system-prompt-cap", "0"], capsys)


class _FakeFarm:
    started: list[list[str]] = []

    def __init__(self, state_dir, replicas, ports, demo_adapters, replica_args, router_args, progress):
        self.model_dir = Path(state_dir) / "models" / "dev"
        Path(state_dir).mkdir(parents=True, exist_ok=True)  # (the real farm makes its state dir)
        self.replica_args = replica_args
        _FakeFarm.started.append(list(replica_args))

    def up(self) -> dict:
        return {"registry_url": "http://registry", "admin_token": "t", "router_url": "http://router",
                "replicas": [{"url": "http://r0"}, {"url": "http://r1"}]}  # fmt: skip

    def stop(self) -> None:
        pass


def _prom(path: Path, stamp: float, queries: float, hits: float) -> None:
    # the replica's counters as prometheus_client renders them (a Counter named without _total)
    path.write_text(f"# lorafarm-scrape-time {stamp}\n# url x\n"
                    "# TYPE lorafarm_prefix_cache_queries counter\n"
                    f'lorafarm_prefix_cache_queries_total{{replica="r"}} {queries}\n'
                    "# TYPE lorafarm_prefix_cache_hits counter\n"
                    f'lorafarm_prefix_cache_hits_total{{replica="r"}} {hits}\n')  # fmt: skip


def test_ab_prefix_cache_runs_the_same_sweep_with_the_cache_then_without(tmp_path, monkeypatch, capsys):
    _FakeFarm.started = []
    calls = []

    async def fake_upload(*args, **kw):
        return SimpleNamespace(api_key="lf-key", aliases=["t/a:prod", "t/b:prod"], summary=lambda tenant: "2 adapters")

    def fake_locust(target, out, name, *, rate, duration, warmup, workload, **kw):
        on = "--no-prefix-cache" not in _FakeFarm.started[-1]
        calls.append((name, rate, dict(workload)))
        out.mkdir(parents=True, exist_ok=True)
        metrics = out / f"{name}-metrics"
        metrics.mkdir()
        for i in range(2):  # two replicas: 1,000 prompt tokens looked up each, 600 served with the cache on
            _prom(metrics / f"replica{i}-start.prom", 100.0, 50, 10)
            _prom(metrics / f"replica{i}-end.prom", 130.0, 1050, 610 if on else 10)
        for label, load in (("start", 3.5), ("end", 4.25)):
            (metrics / f"cpu-{label}.json").write_text(json.dumps({"time": 100.0, "proc_stat_cpu": "cpu 1 1 1 1 1",
                                                                   "loadgen_cpu_s": 0.0, "loadavg": [load, 1, 1]}))  # fmt: skip
        # TTFT grows with the rate; the cache takes 40% off; without it the 4 req/s step fails the 1 s SLO
        ttft = 0.3 * rate * (0.6 if on else 1.0)
        path = out / f"{name}-requests.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, ["phase", "tier", "error", "ttft_s", "tpot_s", "e2e_s", "itl_max_s", "output_tokens",
                                   "sent_s", "prompt_tokens", "cached_tokens", "system_words"])  # fmt: skip
            w.writeheader()
            for k in range(20):
                w.writerow({"phase": "measure", "tier": "gpu", "error": "", "ttft_s": ttft, "tpot_s": 0.01,
                            "e2e_s": ttft + 0.1, "itl_max_s": 0.02, "output_tokens": 11, "sent_s": k,
                            "prompt_tokens": 500, "cached_tokens": 400 if on and k % 2 else 0,
                            "system_words": 150 if k % 4 else 0})  # fmt: skip
        return path

    monkeypatch.setattr(farm_mod, "Farm", _FakeFarm)
    monkeypatch.setattr(synth, "synth_upload", fake_upload)
    monkeypatch.setattr(lt_cli, "_wait_models", lambda url, key, want: ["t/a:prod", "t/b:prod"])
    monkeypatch.setattr(runner, "run_locust", fake_locust)
    out = tmp_path / "lt"
    rc = main(["loadtest", "--ab-prefix-cache", "--system-prompt-share", "0.75", "--system-prompt-median", "150",
               "--slots", "4", "--rates", "1,4", "--duration", "30", "--warmup", "5", "--replica-arg=--max-batch=8",
               "--state-dir", str(tmp_path / "state"), "--out", str(out), "--quiet"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    # a fresh farm per variant, the cache on first; only the flag differs
    assert _FakeFarm.started == [["--slots", "4", "--max-batch=8"], ["--slots", "4", "--max-batch=8", "--no-prefix-cache"]]
    assert [c[:2] for c in calls] == [("prefix-on-1", 1.0), ("prefix-on-4", 4.0), ("prefix-off-1", 1.0),
                                      ("prefix-off-4", 4.0)]  # fmt: skip
    # the same seeded workload in both variants, step by step; each rate step draws its own requests
    assert calls[0][2] == calls[2][2] and calls[1][2] == calls[3][2]
    assert (calls[0][2]["seed"], calls[1][2]["seed"]) == (0, 1)
    assert {k: v for k, v in calls[0][2].items() if k != "seed"} == {k: v for k, v in calls[1][2].items() if k != "seed"}
    assert calls[0][2]["system_prompt_share"] == 0.75 and calls[0][2]["system_prompt_median"] == 150

    with open(out / "sweep.csv", newline="") as f:
        rows = {(r["run"], float(r["rate"])): r for r in csv.DictReader(f) if r["group"] == "all"}
    on, off = rows[("prefix-on", 1.0)], rows[("prefix-off", 1.0)]
    assert float(on["prefix_hit_rate"]) == pytest.approx(0.6) and float(off["prefix_hit_rate"]) == 0
    assert float(on["cached_share"]) == pytest.approx(0.4) and float(off["cached_share"]) == 0
    assert int(on["system_prompt_requests"]) == 15 and on["prefix_cache"] == "on" and off["prefix_cache"] == "off"
    assert float(on["load_start"]) == 3.5 and float(on["load_end"]) == 4.25
    assert [r["seed"] for r in (on, rows[("prefix-on", 4.0)], off)] == ["0", "1", "0"]

    report = (out / "report.md").read_text()
    assert "## Prefix cache A/B (same seeded replay)" in report
    assert "75.0% of requests carry their adapter's system prompt (log-normal, median 150 words" in report
    assert ("**Highest rate with p95 TTFT < 1 s and zero errors: 4 req/s with the prefix cache, 1 req/s "
            "without.**") in report  # fmt: skip
    line = next(x for x in report.splitlines() if x.startswith("| 4.00 | 20/20"))
    assert "| 720 | 1200 | 0.60 | 60.0% | 40.0%/0.0% | 3.5-4.2 / 3.5-4.2 |" in line
    assert "prefix cache off." in report  # the sweep's own header says which variant it is


def test_cache_rates_read_the_prefix_counters(tmp_path):
    _prom(tmp_path / "replica0-start.prom", 100.0, 0, 0)
    _prom(tmp_path / "replica0-end.prom", 160.0, 400, 100)
    r = runner.cache_rates(tmp_path)
    assert r["prefix_hit_rate"] == pytest.approx(0.25) and r["prefix_queries"] == 400
    _prom(tmp_path / "replica0-end.prom", 160.0, 0, 0)
    assert math.isnan(runner.cache_rates(tmp_path)["prefix_hit_rate"])  # no queries: no rate


def test_hit_rate_from_the_replicas_real_prefix_cache_exposition(tmp_path):
    """The replica's own collector (handler/serving/metrics.py) as scraped at the window's start and end:
    the load test reads its counters under their names (and not the vllm: copies twice)."""
    from handler.serving.metrics import ReplicaMetrics

    m = ReplicaMetrics("r0")
    st = SimpleNamespace(prefix_cache_queries=100, prefix_cache_hits=10, prefix_cache_evictions=0, prefix_cache_blocks=1,
                         prefix_cache_deferred=0)
    m.watch_prefix_cache(SimpleNamespace(engine=SimpleNamespace(stats=lambda: st)))
    (tmp_path / "replica0-start.prom").write_text("# lorafarm-scrape-time 100\n" + m.render().decode())
    st.prefix_cache_queries, st.prefix_cache_hits = 500, 310
    (tmp_path / "replica0-end.prom").write_text("# lorafarm-scrape-time 160\n" + m.render().decode())
    r = runner.cache_rates(tmp_path)
    assert r["prefix_queries"] == 400 and r["prefix_hit_rate"] == pytest.approx(0.75)


def test_locust_sends_the_system_prompt_and_records_cached_tokens(tmp_path):
    """The locust suite against a stand-in router (stdlib HTTP, SSE): the requests that carry a system
    prompt send it as the first chat message, the same text per adapter, and the requests CSV keeps
    usage.prompt_tokens_details.cached_tokens."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from loadtests.workload import WorkloadSpec, system_prompt

    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            cached = 32 if body["messages"][0]["role"] == "system" else 0
            events = [{"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                      {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
                                                "prompt_tokens_details": {"cached_tokens": cached}}}]  # fmt: skip
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-adapter-tier", "gpu")
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = runner.Target(f"http://127.0.0.1:{server.server_port}", "lf-key", ["t/a:prod", "t/b:prod", "t/c:prod"])
        options = {"zipf": 1.1, "seed": 4, "prompt_median": 12, "prompt_sigma": 0.6, "output_median": 4,
                   "output_sigma": 0.5, "output_cap": 8, "trace": "", "system_prompt_share": 0.5,
                   "system_prompt_median": 40, "system_prompt_sigma": 0.5, "system_prompt_cap": 100}  # fmt: skip
        path = runner.run_locust(target, tmp_path, "s", rate=10.0, duration=2.0, warmup=0.0, workload=options,
                                 progress=False)  # fmt: skip
    finally:
        server.shutdown()
    rows = runner.read_requests(path)
    assert len(rows) == len(bodies) >= 8 and not [r for r in rows if r["error"]]
    spec = WorkloadSpec(seed=4, system_prompt_share=0.5, system_prompt_words_median=40, system_prompt_words_cap=100)
    with_system = [b for b in bodies if b["messages"][0]["role"] == "system"]
    assert 0 < len(with_system) < len(bodies)
    for b in with_system:
        assert [m["role"] for m in b["messages"]] == ["system", "user"]
        assert b["messages"][0]["content"] == system_prompt(b["model"], spec)
    assert all(len(b["messages"]) == 1 for b in bodies if b not in with_system)
    assert {r["cached_tokens"] for r in rows} == {"0", "32"}
    assert sum(1 for r in rows if int(r["system_words"]) > 0) == len(with_system)
    assert (tmp_path / "s-metrics" / "cpu-end.json").exists()
    assert len(json.loads((tmp_path / "s-metrics" / "cpu-end.json").read_text())["loadavg"]) == 3
