"""Foreign workers and latency-critical models in the registry: CRUD, validation, the routing table
(with its version bump), and no secret ever stored (only the environment variable's name)."""

from __future__ import annotations


async def _table(client) -> dict:
    r = await client.get("/internal/routing")
    assert r.status_code == 200
    return r.json()


async def test_workers_crud_and_routing_table(client):
    before = await _table(client)
    r = await client.put("/internal/workers/gpu-box", json={"url": "http://10.0.0.5:8000/", "kind": "openai",
                                                           "api_key_env": "LORAFARM_WORKER_KEY_GPU_BOX", "weight": 4})
    assert r.status_code == 200, r.text
    assert r.json()["url"] == "http://10.0.0.5:8000" and r.json()["weight"] == 4
    r = await client.put("/internal/workers/ollama1", json={"url": "http://10.0.0.6:11434", "kind": "ollama"})
    assert r.status_code == 200
    table = await _table(client)
    assert table["version"] > before["version"]
    workers = {w["name"]: w for w in table["workers"]}
    assert workers["gpu-box"]["api_key_env"] == "LORAFARM_WORKER_KEY_GPU_BOX" and workers["ollama1"]["kind"] == "ollama"
    # update in place
    r = await client.put("/internal/workers/gpu-box", json={"url": "http://10.0.0.5:8000", "kind": "openai",
                                                           "weight": 2})
    assert r.json()["weight"] == 2 and r.json()["api_key_env"] is None
    listed = (await client.get("/internal/workers")).json()
    assert [w["name"] for w in listed if w["name"] in ("gpu-box", "ollama1")] == ["gpu-box", "ollama1"]
    assert (await client.delete("/internal/workers/gpu-box")).status_code == 204
    assert (await client.delete("/internal/workers/gpu-box")).status_code == 404
    assert (await client.delete("/internal/workers/ollama1")).status_code == 204
    assert not [w for w in (await _table(client))["workers"] if w["name"] in ("gpu-box", "ollama1")]


async def test_workers_bad_input(client):
    for body in (
        {"url": "ftp://x", "kind": "openai"},
        {"url": "http://x:1", "kind": "vllm"},
        {"url": "http://x:1", "kind": "openai", "weight": 0},
        {"url": "http://x:1", "kind": "openai", "api_key_env": "sk-live-123"},  # a key, not a variable name
        {"url": "http://x:1", "kind": "openai", "api_key_env": "LORAFARM_ADMIN_TOKEN"},  # the router's secrets
        {"url": "http://x:1", "kind": "openai", "api_key_env": "HOME"},
        {"url": "http://x:1", "kind": "openai", "api_key_env": "GPU_BOX_KEY"},  # not LORAFARM_WORKER_KEY_*
        {"url": "http://x:1", "kind": "openai", "api_key": "sk-live-123"},  # secrets are not accepted at all
    ):
        r = await client.put("/internal/workers/w1", json=body)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert r.json()["error"]["message"]
    r = await client.put("/internal/workers/bad name!", json={"url": "http://x:1", "kind": "openai"})
    assert 400 <= r.status_code < 500


async def test_critical_models(client):
    r = await client.post("/internal/models/critical", json={"model": "org/model-7b:q4"})
    assert r.status_code == 200 and "org/model-7b:q4" in [m["model"] for m in r.json()]
    v = (await _table(client))["version"]
    again = await client.post("/internal/models/critical", json={"model": "org/model-7b:q4"})  # idempotent
    assert again.status_code == 200 and (await _table(client))["version"] == v
    assert "org/model-7b:q4" in (await _table(client))["critical_models"]
    r = await client.post("/internal/models/critical", json={"model": "org/model-7b:q4", "critical": False})
    assert r.status_code == 200 and "org/model-7b:q4" not in [m["model"] for m in r.json()]
    assert (await client.post("/internal/models/critical", json={"model": ""})).status_code in (400, 422)


async def test_api_key_env_outside_the_prefix_is_400_naming_the_rule(client):
    r = await client.put("/internal/workers/w2", json={"url": "http://x:1", "kind": "openai",
                                                      "api_key_env": "LORAFARM_ADMIN_TOKEN"})
    assert r.status_code == 400, r.text
    assert "LORAFARM_WORKER_KEY_" in r.json()["error"]["message"]
    assert "w2" not in {w["name"] for w in (await client.get("/internal/workers")).json()}


async def test_worker_and_critical_model_changes_are_audited(client):
    async def rows(target):
        r = await client.get("/internal/audit", params={"target": target})
        assert r.status_code == 200, r.text
        return r.json()

    h = {"x-lorafarm-actor": "ops@example"}
    body = {"url": "http://10.0.0.7:8000", "kind": "openai", "api_key_env": "LORAFARM_WORKER_KEY_BOX7"}
    assert (await client.put("/internal/workers/box7", json=body, headers=h)).status_code == 200
    assert (await client.put("/internal/workers/box7", json={**body, "weight": 3}, headers=h)).status_code == 200
    assert (await client.delete("/internal/workers/box7", headers=h)).status_code == 204
    got = await rows("box7")
    assert [a["action"] for a in got] == ["worker.remove", "worker.update", "worker.add"]  # newest first
    assert all(a["target_kind"] == "worker" and a["actor"] == "ops@example" for a in got)
    add = got[2]["detail"]
    assert add["url"] == "http://10.0.0.7:8000" and add["api_key_env"] == "LORAFARM_WORKER_KEY_BOX7"
    assert got[1]["detail"]["previous"] == {"weight": 1.0} and got[1]["detail"]["weight"] == 3
    # a refused change writes no row
    bad = await client.put("/internal/workers/box8", json={**body, "api_key_env": "HOME"})
    assert bad.status_code == 400 and await rows("box8") == []

    model = "org/crit-model:q4"
    await client.post("/internal/models/critical", json={"model": model}, headers=h)
    await client.post("/internal/models/critical", json={"model": model}, headers=h)  # no change: no row
    await client.post("/internal/models/critical", json={"model": model, "critical": False}, headers=h)
    got = await rows(model)
    assert [a["action"] for a in got] == ["model.uncritical", "model.critical"]
    assert all(a["target_kind"] == "model" for a in got)
