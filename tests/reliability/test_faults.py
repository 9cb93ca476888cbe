"""The fault suite on the shared farm: replica SIGSTOP/SIGCONT and SIGKILL (before and mid-stream),
registry down and restarted after more than --replica-timeout (item 1), object store down. Every
test puts the farm back as it found it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import httpx
import openai
import pytest

from tests.reliability.conftest import (
    client, reg_call, restart_replica, router_health, signal_replica, wait_for,
)

MSG = [{"role": "user", "content": "hello"}]
SAFETY = 40.0  # client timeout: a hang fails the test instead of blocking the suite


def _which_replica(rfarm, key, alias) -> int:
    raw = client(rfarm, key).chat.completions.with_raw_response.create(
        model=alias, messages=MSG, max_tokens=2, temperature=0)
    rid = raw.headers["x-replica-id"]
    return [r["replica_id"] for r in rfarm["replicas"]].index(rid)


def _all_healthy(rfarm):
    return router_health(rfarm)["replicas_healthy"] == len(rfarm["replicas"])


def _stream_events(rfarm, key, alias, max_tokens=300):
    """httpx stream through the router: yields (headers, iterator of SSE data payloads)."""
    body = {"model": alias, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    return httpx.stream("POST", rfarm["router_url"] + "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {key}"}, timeout=SAFETY)


def _data_lines(resp):
    for line in resp.iter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


@pytest.fixture
def alias_on(rfarm, rtenant, markers):
    """(alias, marker, index of the replica serving it warm)."""
    alias = sorted(rtenant["aliases"])[0]
    for _ in range(3):
        i = _which_replica(rfarm, rtenant["api_key"], alias)
    return alias, markers[alias], i


def test_frozen_replica_requests_fail_over_before_the_first_byte(rfarm, rtenant, alias_on):
    alias, marker, i = alias_on
    c = client(rfarm, rtenant["api_key"], timeout=SAFETY)
    signal_replica(rfarm, i, signal.SIGSTOP)
    try:
        stream = c.chat.completions.create(model=alias, messages=MSG, max_tokens=24, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == marker
        r = c.chat.completions.create(model=alias, messages=MSG, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == marker
        # the router's health check takes the frozen replica out of routing on its own
        wait_for(lambda: router_health(rfarm)["replicas_healthy"] == len(rfarm["replicas"]) - 1, 15,
                 what="frozen replica out of routing")
        for _ in range(3):
            raw = c.chat.completions.with_raw_response.create(model=alias, messages=MSG, max_tokens=24, temperature=0)
            assert raw.headers["x-replica-id"] != rfarm["replicas"][i]["replica_id"]
            assert raw.parse().choices[0].message.content == marker
    finally:
        signal_replica(rfarm, i, signal.SIGCONT)
    wait_for(lambda: _all_healthy(rfarm), 20, what="thawed replica back in routing")


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "sigkill"])
def test_replica_dies_mid_stream_the_client_gets_an_error_event(rfarm, rtenant, alias_on, sig):
    alias, _, _ = alias_on
    with _stream_events(rfarm, rtenant["api_key"], alias) as resp:
        assert resp.status_code == 200
        rid = resp.headers["x-replica-id"]
        i = [r["replica_id"] for r in rfarm["replicas"]].index(rid)
        events = _data_lines(resp)
        seen = 0
        for data in events:
            if data != "[DONE]" and json.loads(data)["choices"]:
                seen += 1
                if seen == 3:
                    break
        signal_replica(rfarm, i, sig)
        try:
            rest = list(events)  # ends: the router's read timeout, or the dead connection
        finally:
            if sig == signal.SIGSTOP:
                signal_replica(rfarm, i, signal.SIGCONT)
    assert rest[-1] == "[DONE]"
    errors = [json.loads(d)["error"] for d in rest if d != "[DONE]" and "error" in json.loads(d)]
    assert errors and errors[0]["type"] == "server_error"
    if sig == signal.SIGKILL:
        restart_replica(rfarm, i)
    wait_for(lambda: _all_healthy(rfarm), 30, what="replica back in routing")


def test_registry_down_longer_than_replica_timeout_then_restarted(rfarm, rtenant, markers):
    """Item 1: while the registry is down the farm serves (router /health says degraded); after it
    comes back having missed every heartbeat for longer than --replica-timeout, nothing is dropped."""
    farm = rfarm["_farm"]
    alias = sorted(rtenant["aliases"])[1]
    c = client(rfarm, rtenant["api_key"], timeout=SAFETY)
    # the adapter must be on a replica before the registry goes (a cold lookup needs the registry),
    # and the router must have seen where (its next state poll)
    assert c.chat.completions.create(model=alias, messages=MSG, max_tokens=24,
                                     temperature=0).choices[0].message.content == markers[alias]
    time.sleep(2.5)
    proc = farm.procs["registry"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    try:
        wait_for(lambda: router_health(rfarm)["status"] == "degraded", 10, what="router /health degraded")
        deadline = time.monotonic() + 4.0  # > --replica-timeout 3
        while time.monotonic() < deadline:
            assert c.chat.completions.create(model=alias, messages=MSG, max_tokens=24,
                                             temperature=0).choices[0].message.content == markers[alias]
    finally:
        farm.start_registry()
    listed = reg_call(rfarm, lambda reg: reg.list_replicas())
    assert sorted(r["status"] for r in listed) == ["up", "up"], listed
    served = 0
    deadline = time.monotonic() + 6.0  # past the registry's start-up grace and the replicas' backoff
    while time.monotonic() < deadline:
        assert c.chat.completions.create(model=alias, messages=MSG, max_tokens=24,
                                         temperature=0).choices[0].message.content == markers[alias]
        served += 1
    assert served > 0
    wait_for(lambda: router_health(rfarm)["status"] == "ok", 10, what="router /health ok")
    assert _all_healthy(rfarm)


def test_object_store_down_cold_loads_fail_clearly_warm_ones_serve(rfarm, rtenant, markers, canary_index):
    farm = rfarm["_farm"]
    name = sorted(canary_index)[-1]  # not among the farm's adapters: cold everywhere
    alias = "demo/cold:prod"
    uploaded = reg_call(rfarm, lambda reg: reg.upload_adapter(_extra(farm, name), "demo", alias=alias,
                                                              base_model="lorafarm-dev-tiny"))
    store = farm.state_dir / "store"
    away = farm.state_dir / "store-away"
    os.rename(store, away)
    try:
        c = client(rfarm, rtenant["api_key"], timeout=SAFETY)
        with pytest.raises(openai.InternalServerError) as exc:
            c.chat.completions.create(model=alias, messages=MSG, max_tokens=8, temperature=0)
        assert exc.value.status_code == 503
        assert uploaded["adapter_id"] in exc.value.message
        warm = sorted(rtenant["aliases"])[0]
        assert c.chat.completions.create(model=warm, messages=MSG, max_tokens=24,
                                         temperature=0).choices[0].message.content == markers[warm]
    finally:
        os.rename(away, store)
    r = client(rfarm, rtenant["api_key"], timeout=SAFETY).chat.completions.create(
        model=alias, messages=MSG, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == canary_index[name]["marker"]


def _extra(farm, name):
    """A canary the farm was not seeded with, copied from the shared cache."""
    from tests.conftest import CACHE

    dest = farm.state_dir / "extra-adapters" / name
    if not dest.exists():
        shutil.copytree(CACHE / "canaries-tiny-s0" / name, dest)
    return dest


def test_slow_replica_gets_less_traffic(rfarm, rtenant):
    """A replica that runs a quarter of the time (SIGSTOP/SIGCONT duty cycle) is not frozen (it
    answers its polls) but slow: its requests stay in flight longer, so least-tokens routing sends
    most base-model requests to the other one."""
    import concurrent.futures as cf
    import threading

    slow = 1
    stop = threading.Event()

    def duty_cycle():
        while not stop.is_set():
            signal_replica(rfarm, slow, signal.SIGSTOP)
            time.sleep(0.3)
            signal_replica(rfarm, slow, signal.SIGCONT)
            time.sleep(0.1)

    c = client(rfarm, rtenant["api_key"], timeout=SAFETY)

    def one(_):
        raw = c.chat.completions.with_raw_response.create(model="lorafarm-dev-tiny", messages=MSG, max_tokens=16,
                                                          extra_body={"ignore_eos": True})
        return raw.headers["x-replica-id"]

    cycler = threading.Thread(target=duty_cycle, daemon=True)
    cycler.start()
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            served = list(pool.map(one, range(40)))
    finally:
        stop.set()
        cycler.join()
        signal_replica(rfarm, slow, signal.SIGCONT)
    counts = {r["replica_id"]: served.count(r["replica_id"]) for r in rfarm["replicas"]}
    print("slow replica:", counts)
    assert counts[rfarm["replicas"][slow]["replica_id"]] < counts[rfarm["replicas"][1 - slow]["replica_id"]]
    wait_for(lambda: _all_healthy(rfarm), 20, what="replica back in routing")
