"""Issue 21, items 9-10 end to end (real registry, router and replicas): a client mistake is a 4xx
OpenAI error object at the router and at the replica, never a 5xx an OpenAI client would retry (and
an operator be paged for); one limit for `n` on both sides."""

from __future__ import annotations

import httpx
import pytest

from lorafarm.limits import MAX_N

BASE = "lorafarm-dev-tiny"
MSG = [{"role": "user", "content": "hi"}]


def _router(farm, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(farm["router_url"] + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {farm['tenants'][0]['api_key']}"})


def _replica(farm, i: int, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(farm["replicas"][i]["url"] + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {farm['admin_token']}"})


def _is_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith(param) and err["message"]


@pytest.mark.parametrize("bias", [{"²": 5}, {"٣": 5}, {"1": "5"}])
def test_unreadable_logit_bias_is_400_at_router_and_every_replica(farm, bias):
    body = {"model": BASE, "messages": MSG, "max_tokens": 2, "logit_bias": bias}
    _is_400(_router(farm, body), "logit_bias")
    for i in range(len(farm["replicas"])):
        _is_400(_replica(farm, i, body), "logit_bias")
        _is_400(_replica(farm, i, {"model": BASE, "prompt": "hi", "max_tokens": 2, "logit_bias": bias},
                         "/v1/completions"), "logit_bias")
    # a token id outside the vocabulary is the client's mistake too (the engine's check, a 400)
    r = _replica(farm, 0, {**body, "logit_bias": {"999999999": 5}})
    assert r.status_code == 400, r.text
    for rep in farm["replicas"]:  # nothing broke: both replicas still serve
        assert httpx.get(rep["url"] + "/health", timeout=10).status_code == 200
    ok = _router(farm, {**body, "logit_bias": {"1": 5}})
    assert ok.status_code == 200, ok.text


def test_one_limit_for_n_at_router_and_replica(farm):
    body = {"model": BASE, "messages": MSG, "max_tokens": 1, "n": MAX_N + 1}
    _is_400(_router(farm, body), "n")
    _is_400(_replica(farm, 0, body), "n")
    r = _router(farm, {**body, "n": MAX_N})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N, r.text
