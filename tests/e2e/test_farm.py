"""The farm as a newcomer meets it: farm.json, the demo, the OpenAI client through the router."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import farm_json


def test_farm_json_contract(farm):
    info = farm_json(farm)
    assert set(info) >= {"router_url", "registry_url", "admin_token", "tenants", "replicas", "base_models"}
    t = info["tenants"][0]
    assert set(t) >= {"tenant_id", "api_key", "aliases"}
    assert all(set(r) >= {"replica_id", "url", "pid"} for r in info["replicas"])
    assert os.stat(farm["_farm"].farm_json).st_mode & 0o077 == 0  # holds secrets


def test_openai_client_stream_and_usage(farm, tenant, adapter_markers):
    client = OpenAI(base_url=farm["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0)
    alias = sorted(tenant["aliases"])[0]
    chunks = list(
        client.chat.completions.create(
            model=alias,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == adapter_markers[tenant["aliases"][alias]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    models = {m.id for m in client.models.list()}
    assert set(tenant["aliases"]) <= models and "lorafarm-dev-tiny" in models


def test_second_up_on_same_state_dir_reuses_everything(farm):
    """Re-seeding an existing farm keeps the tenant's key and adapter ids (idempotent upload)."""
    f = farm["_farm"]
    again = f.seed()
    assert again["tenants"][0]["api_key"] == farm["tenants"][0]["api_key"]
    assert again["tenants"][0]["aliases"] == farm["tenants"][0]["aliases"]


def test_lorafarm_demo_command(tmp_path, dev_model):
    """The README's smoke test: start a farm, one streamed chat through the openai client, stop. Its
    state dir is seeded with the session's dev model and canaries (the demo would otherwise train
    its 4 canaries again: 443 s on a busy 2-core box); `Farm.prepare` finds them by their cache keys."""
    from lorafarm.farm import DEMO_ADAPTERS
    from tests.conftest import CANARY_DIR, make_canaries
    from tests.e2e.conftest import seeded_farm

    make_canaries(dev_model, DEMO_ADAPTERS)
    seeded_farm(tmp_path, dev_model, CANARY_DIR, replicas=1, adapters=DEMO_ADAPTERS)
    proc = subprocess.run(
        [sys.executable, "-m", "lorafarm", "demo", "--replicas", "1", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "<<c0000>>" in proc.stdout


def _sigint_ignored():
    """In the child before exec: SIGINT ignored, as a script's background job (`make serve &`) gets it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT, inherited ignored"])
def test_up_then_sigterm_stops_every_child(tmp_path, dev_model, canaries, stop):
    """`lorafarm up` in the foreground: ready banner, farm.json, then SIGTERM stops all children; so
    does SIGINT when the farm was started with SIGINT ignored (it left the replicas orphaned)."""
    import json

    from tests.e2e.conftest import read_until, seeded_farm

    ports = seeded_farm(tmp_path, dev_model, canaries, replicas=1, adapters=4).ports
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorafarm", "up", "--dev", "--replicas", "1", "--state-dir", str(tmp_path),
         "--port", str(ports.router), "--registry-port", str(ports.registry), "--replica-port", str(ports.replica_base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_sigint_ignored if stop.startswith("SIGINT") else None,
    )  # fmt: skip
    try:
        banner = read_until(proc, "Ctrl-C stops the farm", 300, logs=tmp_path / "logs")
        assert "Ctrl-C stops the farm" in banner, banner[-3000:]
        info = json.loads((tmp_path / "farm.json").read_text())
        key = info["tenants"][0]["api_key"]
        assert key in banner and "curl -N" in banner and "from openai import OpenAI" in banner
        r = httpx.get(info["router_url"] + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        pids = [r["pid"] for r in info["replicas"]]
    finally:
        proc.send_signal(signal.SIGINT if stop.startswith("SIGINT") else signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    for url in (info["registry_url"], info["router_url"]):  # nothing left listening
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, f"replica pid {pid} still running"
    for port in (ports.router, ports.registry, ports.replica_base):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            raise AssertionError(f"port {port} still answers")
        except httpx.HTTPError:
            pass
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["registry.log", "replica-r0.log", "router.log"]
