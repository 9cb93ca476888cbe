"""What the Kubernetes probes and preStop hook of deploy/ rely on, against a real replica process
thread: /ready only after the first pull, /internal/drain stops new work, the autoscaling gauge."""

from __future__ import annotations

import httpx

from tests.handler.conftest_service import (  # noqa: F401 - fixtures
    ReplicaServer,
    chat_body,
    make_config,
    service_archives,
)

TOKEN = "t0ken"


async def test_ready_drain_and_tokens_gauge(dev_model, service_archives, tmp_path):
    cfg = make_config(dev_model, service_archives, tmp_path, replica_id="rk", admin_token=TOKEN)
    aid = service_archives.good["c0000"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ReplicaServer(cfg) as srv:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.get(f"{srv.url}/ready")  # public, like /health: kubelet sends no token
            assert r.status_code == 200 and r.json()["status"] == "ready"
            metrics = (await http.get(f"{srv.url}/metrics")).text
            assert "lorafarm_tokens_in_flight" in metrics
            assert (await http.post(f"{srv.url}/internal/drain")).status_code == 401
            r = await http.post(f"{srv.url}/v1/chat/completions", json=chat_body(aid), headers=auth)
            assert r.status_code == 200
            r = await http.post(f"{srv.url}/internal/drain", headers=auth)
            assert r.status_code == 200 and r.json()["status"] == "draining"
            r = await http.get(f"{srv.url}/ready")
            assert r.status_code == 503 and r.json()["status"] == "draining"
            r = await http.post(f"{srv.url}/v1/chat/completions", json=chat_body(aid), headers=auth)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            assert (await http.get(f"{srv.url}/metrics")).status_code == 200  # liveness stays up
