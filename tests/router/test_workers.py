"""Foreign workers, pure parts: catalog parsing (OpenAI-compatible `status`, Ollama tags/ps), error
mapping to OpenAI error objects, and warm-first ranking across kinds in `choose()`."""

from __future__ import annotations

import json

import pytest

from router.routing import ReplicaSnapshot, RouteRequest, choose
from router.workers import ForeignWorkers, openai_error_body, parse_ollama, parse_openai_models


def test_parse_openai_models_status_forms():
    body = {"data": [{"id": "a", "status": "loaded"}, {"id": "b", "status": {"value": "loaded"}},
                     {"id": "c", "status": "unloaded"}, {"id": "d"}, {"id": ""}, "junk"]}
    installed, loaded = parse_openai_models(body)
    assert installed == ["a", "b", "c", "d"] and loaded == {"a", "b", "d"}  # no status: served = loaded
    with pytest.raises(ValueError):
        parse_openai_models({"object": "list"})


def test_parse_ollama_tags_and_ps():
    installed, loaded = parse_ollama({"models": [{"name": "llama3:8b"}, {"name": "nomic-embed-text:latest"}]},
                                     {"models": [{"name": "llama3:8b", "size_vram": 1}]})
    assert installed == ["llama3:8b", "nomic-embed-text:latest"] and loaded == {"llama3:8b"}
    with pytest.raises(ValueError):
        parse_ollama({}, {"models": []})


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (404, b'{"error": "model \\"x\\" not found, try pulling it first"}', "model_not_found"),
        (400, b'{"detail": "Server is pinned to \'a\'"}', None),
        (502, b"Bad Gateway", "upstream_error"),
    ],
)
def test_foreign_errors_become_openai_error_objects(status, body, code):
    err = json.loads(openai_error_body(status, body))["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == code
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    ok = b'{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": "x"}}'
    assert openai_error_body(400, ok) == ok


def _worker(rid, models, loaded, weight=1.0, fresh=True, healthy=True, tokens=0):
    return ReplicaSnapshot(replica_id=rid, models=frozenset(models), loaded_models=frozenset(loaded),
                           capacity_weight=weight, state_fresh=fresh, healthy=healthy, tokens_in_flight=tokens)


def test_warm_first_across_kinds_and_never_a_worker_without_the_model():
    req = RouteRequest(model_name="m")
    replicas = [
        _worker("worker:cold", ["m"], [], weight=10),
        _worker("worker:warm", ["m"], ["m"]),
        _worker("worker:stale", ["m"], ["m"], fresh=False),  # catalog unfetchable: possibly warm
        _worker("worker:other", ["x"], ["x"]),
    ]
    ranked = choose(req, replicas, "weighted")
    assert [r.replica_id for r in ranked][0] == "worker:warm"
    assert {r.replica_id for r in ranked[1:]} == {"worker:cold", "worker:stale"}
    assert all(r.klass == "installed" for r in ranked[1:]) and ranked[0].klass == "base"
    assert "worker:other" not in {r.replica_id for r in ranked}
    # a lorafarm replica serving the base by name is warm alongside the loaded worker
    lf = ReplicaSnapshot(replica_id="r0", models=frozenset({"m"}))
    assert {r.replica_id for r in choose(req, [lf, *replicas], "least_tokens")[:2]} == {"r0", "worker:warm"}


def test_weights_and_strategies_order_within_a_class():
    req = RouteRequest(model_name="m")
    big, small = _worker("worker:big", ["m"], [], weight=4), _worker("worker:small", ["m"], [], weight=1)
    assert choose(req, [small, big], "weighted")[0].replica_id == "worker:big"
    busy_big = _worker("worker:big", ["m"], [], weight=4, tokens=1000)
    assert choose(req, [small, busy_big], "weighted")[0].replica_id == "worker:small"
    assert choose(req, [busy_big, small], "least_tokens")[0].replica_id == "worker:small"


def test_worker_registry_apply_and_failures():
    fw = ForeignWorkers(health_failures=2)
    fw.apply([{"name": "a", "url": "http://h:1/", "kind": "openai", "api_key_env": "A_KEY", "weight": 3}])
    e = fw.workers["worker:a"]
    e.installed, e.loaded, e.polled_ok = ("m",), frozenset({"m"}), True
    assert fw.listed_models() == {"m"} and fw.snapshots()[0].capacity_weight == 3
    fw.mark_failure("worker:a")
    assert fw.listed_models() == {"m"}  # one failure: still in routing
    fw.mark_failure("worker:a")
    assert fw.listed_models() == set() and fw.known_models() == {"m"} and not fw.snapshots()[0].healthy
    fw.mark_success("worker:a")
    assert fw.listed_models() == {"m"}
    headers = fw.headers_for("worker:a", {"authorization": "Bearer ADMIN", "x-lorafarm-tenant": "t", "x-request-id": "r"})
    assert "ADMIN" not in json.dumps(headers) and "x-lorafarm-tenant" not in headers
    fw.apply([])
    assert fw.workers == {}
