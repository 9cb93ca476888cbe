"""The fault suite on the shared farm: replica SIGSTOP/SIGCONT and SIGKILL (before and mid-stream,
streamed and not), registry down and restarted after more than --replica-timeout (item 1), object
store down. Every test breaks the farm inside `restored(rfarm)`, which puts it back pass or fail.

A mid-generation fault is not raced against the stream: the request carries `hold_id(n)`, its
replica's engine stops after n tokens (handler/serving/holds.py), and the fault lands while the
request is provably generating."""

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
    all_routed, client, farm_logs, held, hold_id, reg_call, replica_of_pid, restored, router_health,
    signal_replica,
)
from tests.waiting import wait_for

MSG = [{"role": "user", "content": "hello"}]
SAFETY = 40.0  # client timeout: a hang fails the test instead of blocking the suite


def _which_replica(rfarm, key, alias) -> int:
    raw = client(rfarm, key).chat.completions.with_raw_response.create(
        model=alias, messages=MSG, max_tokens=2, temperature=0)
    rid = raw.headers["x-replica-id"]
    return [r["replica_id"] for r in rfarm["replicas"]].index(rid)


def _stream_events(rfarm, key, alias, request_id, max_tokens=300):
    """httpx stream through the router (the response: status, headers, `_data_lines`)."""
    body = {"model": alias, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    return httpx.stream("POST", rfarm["router_url"] + "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {key}", "x-request-id": request_id}, timeout=SAFETY)


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
    with restored(rfarm):
        signal_replica(rfarm, i, signal.SIGSTOP)
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
    assert all_routed(rfarm)


HOLD_AT = 3  # tokens the client has seen when the fault lands


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "sigkill"])
def test_replica_dies_mid_stream_the_client_gets_an_error_event(rfarm, rtenant, alias_on, sig):
    alias, _, _ = alias_on
    rid = hold_id(HOLD_AT)
    with restored(rfarm), _stream_events(rfarm, rtenant["api_key"], alias, rid) as resp:
        assert resp.status_code == 200
        events = _data_lines(resp)
        seen = 0
        for data in events:
            if data != "[DONE]" and json.loads(data)["choices"]:
                seen += 1
                if seen == HOLD_AT:
                    break
        # the replica's engine is held after HOLD_AT tokens: 297 more are still to come
        pid = wait_for(lambda: held(rfarm, rid), 30, what=f"request {rid} held on its replica")
        i = replica_of_pid(rfarm, pid)
        assert rfarm["replicas"][i]["replica_id"] == resp.headers["x-replica-id"]
        signal_replica(rfarm, i, sig)
        rest = list(events)  # ends: the router's read timeout, or the dead connection
    assert rest[-1] == "[DONE]"
    errors = [json.loads(d)["error"] for d in rest if d != "[DONE]" and "error" in json.loads(d)]
    assert errors and errors[0]["type"] == "server_error", rest[-5:]


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "sigkill"])
def test_replica_dies_mid_generation_non_streamed_the_request_completes_elsewhere(rfarm, rtenant, alias_on, sig):
    """Nothing has reached the client of a non-streamed request when its replica dies (or freezes)
    mid-generation: the router fails it over, and it is answered whole, by the other replica."""
    import concurrent.futures as cf

    alias, marker, _ = alias_on
    rid = hold_id(HOLD_AT)
    c = client(rfarm, rtenant["api_key"], timeout=SAFETY)
    with restored(rfarm), cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.chat.completions.with_raw_response.create, model=alias, messages=MSG, max_tokens=24,
                             temperature=0, extra_headers={"x-request-id": rid})
        pid = wait_for(lambda: held(rfarm, rid) or (answer.done() and answer.result()), 30,
                       what=f"request {rid} held on its replica")
        assert isinstance(pid, int), "answered before the fault: the hold point did not hold"
        i = replica_of_pid(rfarm, pid)
        signal_replica(rfarm, i, sig)
        raw = answer.result(timeout=SAFETY)
    assert raw.headers["x-replica-id"] != rfarm["replicas"][i]["replica_id"]
    assert raw.parse().choices[0].message.content == marker


def test_registry_down_longer_than_replica_timeout_then_restarted(rfarm, rtenant, markers):
    """Item 1: while the registry is down the farm serves (router /health says degraded); after it
    comes back having missed every heartbeat for longer than --replica-timeout, nothing is dropped."""
    farm = rfarm["_farm"]
    alias = sorted(rtenant["aliases"])[1]
    c = client(rfarm, rtenant["api_key"], timeout=SAFETY)
    # the adapter must be on a replica before the registry goes (a cold lookup needs the registry),
    # and the router must have seen where (its next state poll): it then routes the alias warm
    def routed_warm() -> bool:
        raw = c.chat.completions.with_raw_response.create(model=alias, messages=MSG, max_tokens=24,
                                                          temperature=0)
        assert raw.parse().choices[0].message.content == markers[alias]
        return raw.headers["x-route-class"] == "warm"

    wait_for(routed_warm, 30, interval=0.5, what=f"{alias} routed warm", logs=farm_logs(rfarm))
    with restored(rfarm):
        proc = farm.procs["registry"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        try:
            wait_for(lambda: router_health(rfarm)["status"] == "degraded", 10, what="router /health degraded")
            # serving on for a while is the subject: past --replica-timeout 3 with the registry down
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                assert c.chat.completions.create(model=alias, messages=MSG, max_tokens=24,
                                                 temperature=0).choices[0].message.content == markers[alias]
        finally:
            farm.start_registry()
        listed = reg_call(rfarm, lambda reg: reg.list_replicas())
        assert sorted(r["status"] for r in listed) == ["up", "up"], listed
        served = 0
        # serving on for a while is the subject: past the registry's start-up grace and the replicas' backoff
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            assert c.chat.completions.create(model=alias, messages=MSG, max_tokens=24,
                                             temperature=0).choices[0].message.content == markers[alias]
            served += 1
        assert served > 0
        wait_for(lambda: router_health(rfarm)["status"] == "ok", 10, what="router /health ok")
    assert all_routed(rfarm)


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
            time.sleep(0.3)  # the duty cycle is the subject: stopped 0.3 s, running 0.1 s
            signal_replica(rfarm, slow, signal.SIGCONT)
            time.sleep(0.1)

    c = client(rfarm, rtenant["api_key"], timeout=SAFETY)

    def one(_):
        raw = c.chat.completions.with_raw_response.create(model="lorafarm-dev-tiny", messages=MSG, max_tokens=16,
                                                          extra_body={"ignore_eos": True})
        return raw.headers["x-replica-id"]

    cycler = threading.Thread(target=duty_cycle, daemon=True)
    with restored(rfarm):
        cycler.start()
        try:
            with cf.ThreadPoolExecutor(4) as pool:
                served = list(pool.map(one, range(40)))
        finally:
            stop.set()
            cycler.join()
    counts = {r["replica_id"]: served.count(r["replica_id"]) for r in rfarm["replicas"]}
    print("slow replica:", counts)
    assert counts[rfarm["replicas"][slow]["replica_id"]] < counts[rfarm["replicas"][1 - slow]["replica_id"]]
