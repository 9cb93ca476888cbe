"""Issue 35 items 6 and 7 on the shared reliability farm (registry, router and two replicas as real
processes on 127.0.0.1):

- malformed text is a 400 invalid_request_error at the router before any replica is tried (a lone
  UTF-16 surrogate in chat content, a system message, a completions prompt, stop strings, tool
  fields, an embeddings input; booleans and other non-integer token ids), and a 400 at each replica
  called directly (before: 500 from the tokenizer, tried on both replicas);
- a revoke or rotate returns only once the router refuses the old key: the next request right
  after the call is refused (before: up to 3 requests served, 0.24 s after the call returned);
- a registry outage shorter than the stated bound (`--auth-stale-grace`, 300 s) keeps an active key
  serving although its cache entry expires (the router runs with `--auth-ttl 1` here), while a key
  this router never verified gets 503 auth_unavailable until the registry is back.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai

from tests.reliability.conftest import (
    ROUTER_ARGS, admin, client, reg_call, restored, router_health, wait_routed,
)
from tests.waiting import wait_for

MSG = [{"role": "user", "content": "hello"}]
LONE = "a\ud800b"
BASE = "lorafarm-dev-tiny"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}

# (endpoint, body without model, the param the 400 names)
MALFORMED = [
    ("chat", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("chat", {"messages": [{"role": "system", "content": LONE}, *MSG]}, "messages.0.content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages.0.content.0.text"),
    ("chat", {"messages": MSG, "stop": [LONE]}, "stop.0"),
    ("chat", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "description": LONE}}]},
     "tools.0.function.description"),
    ("completions", {"prompt": LONE}, "prompt"),
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"prompt": [1.5, 2]}, "prompt"),
    ("embeddings", {"input": ["fine", LONE]}, "input.1"),
]


def _raw(model: str, body: dict) -> bytes:
    return json.dumps({"model": model, "max_tokens": 4, **body} if "input" not in body
                      else {"model": model, **body}).encode()  # ensure_ascii: "\ud800" stays an escape


def _metric(url: str, name: str, *match: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(m in line for m in match))


def test_malformed_text_is_400_at_the_router_before_any_replica(rfarm, rtenant):
    alias = sorted(rtenant["aliases"])[0]
    headers = {"Authorization": f"Bearer {rtenant['api_key']}", "content-type": "application/json"}
    for endpoint, body, param in MALFORMED:
        before = _metric(rfarm["router_url"], "lorafarm_router_requests_total", f'endpoint="{endpoint}"',
                         'status="400"', 'route_class="none"')
        r = httpx.post(rfarm["router_url"] + PATHS[endpoint], content=_raw(alias, body), headers=headers, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert "x-replica-id" not in r.headers  # answered by the router itself: no replica tried
        # counted as refused at the gateway (route class "none"), never as a replica's answer
        assert _metric(rfarm["router_url"], "lorafarm_router_requests_total", f'endpoint="{endpoint}"',
                       'status="400"', 'route_class="none"') == before + 1


def test_malformed_text_is_400_at_each_replica_called_directly(rfarm, rtenant):
    aid = rtenant["aliases"][sorted(rtenant["aliases"])[0]]
    for r in rfarm["replicas"]:
        for endpoint, body, param in MALFORMED:
            if endpoint == "embeddings":
                continue  # a generating replica has no embeddings (the worker's parser: tests/router)
            resp = httpx.post(r["url"] + PATHS[endpoint], content=_raw(aid, body),
                              headers={**admin(rfarm), "content-type": "application/json"}, timeout=30)
            assert resp.status_code == 400, (r["replica_id"], body, resp.text)
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
        ok = httpx.post(r["url"] + "/v1/completions", json={"model": aid, "prompt": [1, 2, 3], "max_tokens": 2},
                        headers=admin(rfarm), timeout=30)
        assert ok.status_code == 200, ok.text  # token ids that are integers still work


def _refused(c: openai.OpenAI) -> bool:
    try:
        c.models.list()
    except openai.AuthenticationError:
        return True
    return False


def test_a_revoke_returns_only_once_the_router_refuses_the_key(rfarm):
    """The key is verified and cached by the router (30 s TTL), then revoked: the very next request,
    sent right after the registry call returned, is refused (read-your-writes, as alias deploys)."""
    for n in range(3):
        created = reg_call(rfarm, lambda reg: reg.create_tenant(f"revoke-ryw-{n}"))
        c = client(rfarm, created["api_key"])
        for _ in range(2):
            c.models.list()  # verified, then served from the router's cache
        reg_call(rfarm, lambda reg: reg.revoke_key(f"revoke-ryw-{n}", created["key_id"]))
        assert _refused(c), f"revoked key served after the revoke returned (round {n})"


def test_a_rotate_returns_only_once_the_router_refuses_the_old_key(rfarm):
    created = reg_call(rfarm, lambda reg: reg.create_tenant("rotate-ryw"))
    old = client(rfarm, created["api_key"])
    old.models.list()
    rotated = reg_call(rfarm, lambda reg: reg.rotate_keys("rotate-ryw", created["key_id"]))
    assert rotated["revoked_key_ids"] == [created["key_id"]]
    assert _refused(old)
    assert client(rfarm, rotated["api_key"]).models.list() is not None


def test_a_registry_outage_within_the_bound_keeps_an_active_key_serving(rfarm, rtenant, markers):
    """The router runs with a 1 s key cache here, so the active key's entry expires many times over
    during the outage: it keeps serving (verified keys serve while the router heard from the
    registry within --auth-stale-grace, 300 s). A key the router never verified gets 503
    auth_unavailable during the outage, and works once the registry is back."""
    farm = rfarm["_farm"]
    alias = sorted(rtenant["aliases"])[0]
    fresh = reg_call(rfarm, lambda reg: reg.create_tenant("outage-new-key"))  # never used before the outage
    with restored(rfarm):  # the suite's router flags, the registry up, every replica routed again
        farm.restart_router([*ROUTER_ARGS, "--auth-ttl", "1"])
        wait_routed(rfarm, 60, what="router routing to every replica")
        c = client(rfarm, rtenant["api_key"], timeout=40.0)
        assert c.chat.completions.create(model=alias, messages=MSG, max_tokens=24,
                                         temperature=0).choices[0].message.content == markers[alias]
        proc = farm.procs["registry"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        try:
            wait_for(lambda: router_health(rfarm)["status"] == "degraded", 15, what="router /health degraded")
            r = httpx.get(rfarm["router_url"] + "/v1/models", headers={"Authorization": f"Bearer {fresh['api_key']}"},
                          timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "auth_unavailable", r.text
            served, started = 0, time.monotonic()
            while time.monotonic() - started < 6.0:  # six times the key's cache TTL, well within the bound
                assert c.chat.completions.create(model=alias, messages=MSG, max_tokens=24,
                                                 temperature=0).choices[0].message.content == markers[alias]
                served += 1
            assert served > 0
        finally:
            farm.start_registry()
        wait_for(lambda: router_health(rfarm)["status"] == "ok", 30, what="router /health ok")
        assert client(rfarm, fresh["api_key"]).models.list() is not None
