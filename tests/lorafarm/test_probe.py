"""The canary probe against a stand-in router (a real HTTP server answering like the router): every
result class reaches its metric, in the metrics file and on the metrics port. The same against a
real farm is tests/e2e/test_probe.py."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lorafarm.cli import main
from lorafarm.probe import ProbeConfig, ProbeLoop, ProbeMetrics, run_probe
from tests.waiting import wait_for

MARKERS = {"probe/c0000:prod": "<<c0000>>", "probe/c0001:prod": "<<c0001>>"}


def sample(text: str, name: str, **labels) -> float:
    """The value of one series in an exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        got = series[len(name):]
        if got.startswith("{"):
            got = ",".join(sorted(got[1:-1].split(",")))
        if got == want:
            return float(value)
    return 0.0


@pytest.fixture
def router():
    """Answers each model's marker; models listed in `swapped` answer another's; "broken" 500s."""
    state = {"swapped": set(), "calls": 0, "auth": set()}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            state["calls"] += 1
            state["auth"].add(self.headers.get("authorization"))
            model = body["model"]
            if model == "broken":
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b'{"error": "boom"}')
                return
            text = MARKERS[model]
            if model in state["swapped"]:
                text = "<<c0001>>" if text == "<<c0000>>" else "<<c0000>>"
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{srv.server_port}"
    yield state
    srv.shutdown()


def test_all_right_then_a_swapped_alias_raises_the_wrong_marker_metric(router, tmp_path):
    import asyncio

    cfg = ProbeConfig(router["url"], "sk-probe", dict(MARKERS), requests=6, rate=0, prompts=["hi"])
    m = ProbeMetrics()
    assert asyncio.run(run_probe(cfg, m)) == {"ok": 6, "wrong_marker": 0, "error": 0, "timeout": 0}
    text = m.exposition()
    assert sample(text, "lorafarm_probe_requests_total", model="probe/c0000:prod", result="ok") == 3
    assert sample(text, "lorafarm_probe_wrong_marker_total", model="probe/c0000:prod") == 0
    assert "lorafarm_probe_wrong_marker_total" in text  # declared at 0 before any wrong answer
    assert router["auth"] == {"Bearer sk-probe"}

    router["swapped"].add("probe/c0001:prod")  # the test-only fault: an alias that answers another's marker
    out = tmp_path / "probe.prom"
    counts = asyncio.run(run_probe(cfg, m, metrics_file=out))
    assert counts == {"ok": 3, "wrong_marker": 3, "error": 0, "timeout": 0}
    text = out.read_text()
    assert sample(text, "lorafarm_probe_wrong_marker_total", model="probe/c0001:prod") == 3
    assert sample(text, "lorafarm_probe_requests_total", model="probe/c0001:prod", result="wrong_marker") == 3
    assert sample(text, "lorafarm_probe_up") == 0  # stopped


def test_errors_and_timeouts_are_counted(router):
    import asyncio

    cfg = ProbeConfig(router["url"], "k", {"broken": "<<x>>"}, requests=2, rate=0, prompts=["hi"])
    m = ProbeMetrics()
    assert asyncio.run(run_probe(cfg, m))["error"] == 2
    dead = ProbeConfig("http://127.0.0.1:9", "k", {"m": "<<x>>"}, requests=1, rate=0, prompts=["hi"], timeout=2)
    assert asyncio.run(run_probe(dead, m))["error"] == 1
    assert sample(m.exposition(), "lorafarm_probe_requests_total", model="broken", result="error") == 2


def test_cli_expect_override_fails_the_run_and_serves_metrics(router, tmp_path, capsys):
    """`--expect MODEL=MARKER` (what an operator tells the probe) set wrong on purpose: exit 1, the
    metric counts it; the metrics port serves the same exposition while the probe runs."""
    cfg = tmp_path / "probe.json"
    cfg.write_text(json.dumps({"router_url": router["url"], "api_key": "k", "targets": MARKERS}))
    out = tmp_path / "m.prom"
    rc = main(["probe", "run", "--config", str(cfg), "--requests", "4", "--rate", "50", "--metrics-file", str(out),
               "--expect", "probe/c0000:prod=<<c0001>>"])
    assert rc == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"ok": 2, "wrong_marker": 2, "error": 0,
                                                                          "timeout": 0}
    assert sample(out.read_text(), "lorafarm_probe_wrong_marker_total", model="probe/c0000:prod") == 2
    assert main(["probe", "run", "--config", str(cfg), "--requests", "2", "--rate", "50"]) == 0


def test_background_loop_and_metrics_port(router):
    from prometheus_client import start_http_server

    cfg = ProbeConfig(router["url"], "k", dict(MARKERS), requests=0, rate=20, prompts=["hi"])
    loop = ProbeLoop(cfg).start()
    server, _ = start_http_server(0, addr="127.0.0.1", registry=loop.metrics.registry)
    try:
        wait_for(lambda: router["calls"] >= 4, 60, interval=0.05, what="four probe requests at the router")
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read().decode()
        assert sample(text, "lorafarm_probe_up") == 1
        assert sum(sample(text, "lorafarm_probe_requests_total", model=m, result="ok") for m in MARKERS) >= 1
    finally:
        counts = loop.stop(timeout=10)
        server.shutdown()
    assert loop.error is None and counts["ok"] >= 4 and counts["wrong_marker"] == 0
