"""Item 3: a merged-mode replica joins the farm. It serves only its merged adapter: base-model
requests never go to it, no tenant's /v1/models lists it as a model of its own, and every alias's
`parent` stays the base model's name."""

from __future__ import annotations

import signal

import pytest

from lorafarm.farm import BASE_MODEL_NAME, _free_port
from tests.reliability.conftest import client, farm_logs, reg_call, router_health
from tests.waiting import wait_for

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def merged_replica(rfarm, rtenant):
    farm = rfarm["_farm"]
    alias = sorted(rtenant["aliases"])[2]
    adapter_id = rtenant["aliases"][alias]
    state = farm.state_dir.resolve()
    port = _free_port()
    farm._spawn("replica-merged", [
        "replica", "--id", "rm", "--host", "127.0.0.1", "--port", str(port),
        "--base", str(farm.model_dir.resolve()), "--model-name", BASE_MODEL_NAME,
        "--registry", farm.registry_url, "--store-url", f"file://{state / 'store'}",
        "--trust", str(state / "keys" / "public.pem"), "--disk-dir", str(state / "replicas" / "rm"),
        "--merged-adapter", adapter_id,
    ])  # fmt: skip
    try:
        farm.wait_healthy("replica-merged", f"http://127.0.0.1:{port}")
        wait_for(lambda: router_health(rfarm)["replicas_healthy"] == 3, 30, what="merged replica in routing",
                 logs=farm_logs(rfarm, "replica-merged"))
        yield alias, adapter_id
    finally:
        proc = farm.procs.pop("replica-merged")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        wait_for(lambda: router_health(rfarm)["replicas"] == 2, 30, what="merged replica out of the view",
                 logs=farm_logs(rfarm, "replica-merged"))


def test_merged_replica_serves_only_its_adapter(rfarm, rtenant, markers, merged_replica):
    alias, adapter_id = merged_replica
    c = client(rfarm, rtenant["api_key"], timeout=60)
    replicas = set()
    for _ in range(20):
        raw = c.chat.completions.with_raw_response.create(model=BASE_MODEL_NAME, messages=MSG, max_tokens=4)
        assert raw.status_code == 200
        replicas.add(raw.headers["x-replica-id"])
    assert "rm" not in replicas
    served_by = set()
    for _ in range(6):
        raw = c.chat.completions.with_raw_response.create(model=alias, messages=MSG, max_tokens=24, temperature=0)
        assert raw.parse().choices[0].message.content == markers[alias]
        served_by.add(raw.headers["x-replica-id"])
    other = reg_call(rfarm, lambda reg: reg.create_tenant("bystander"))
    for key in (rtenant["api_key"], other["api_key"]):
        listed = client(rfarm, key).models.list().data
        assert all(getattr(m, "parent", None) in (None, BASE_MODEL_NAME) for m in listed)
        entries = [m for m in listed if adapter_id in (m.id, getattr(m, "root", None))]
        if key == other["api_key"]:
            assert entries == []  # another tenant never sees the merged replica's adapter
        else:
            # its owner sees it once (under its alias), as an adapter of the base, never as a model
            # of its own that the merged replica would advertise
            assert [getattr(m, "parent", None) for m in entries] == [BASE_MODEL_NAME]
            assert [m.id for m in entries] == [alias]
    parents = {getattr(m, "parent", None) for m in client(rfarm, rtenant["api_key"]).models.list().data
               if m.id in rtenant["aliases"]}
    assert parents == {BASE_MODEL_NAME}
