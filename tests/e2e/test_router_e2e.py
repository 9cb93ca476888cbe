"""The router's acceptance through real processes (registry + router + 2 replicas, `lorafarm.farm`)
with the official openai client: errors, tenant isolation, warm routing, failover on a dead replica."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from handler.serving.holds import HOLD_ENV
from lorafarm.registry_client import RegistryClient
from tests.e2e.conftest import running, seeded_farm
from tests.waiting import wait_for, wait_until


def _client(farm, key) -> OpenAI:
    return OpenAI(base_url=farm["router_url"] + "/v1", api_key=key, max_retries=0)


def test_errors_are_openai_errors(farm, tenant):
    client = _client(farm, tenant["api_key"])
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="demo/nope:prod", messages=[{"role": "user", "content": "x"}])
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        _client(farm, "sk-wrong").chat.completions.create(
            model=sorted(tenant["aliases"])[0], messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=sorted(tenant["aliases"])[0], messages=[{"role": "user", "content": "x"}],
                                       extra_body={"audio": {"voice": "alloy"}})
    assert exc.value.body["code"] == "unsupported_parameter" and exc.value.body["param"] == "audio"


def test_tenant_isolation(farm, tenant):
    """Tenant B's key reaches neither A's alias nor A's adapter id: the same 404 as a missing model."""

    async def make_tenant():
        async with RegistryClient(farm["registry_url"], farm["admin_token"]) as reg:
            return await reg.create_tenant("intruder")

    other = asyncio.run(make_tenant())
    client = _client(farm, other["api_key"])
    alias, adapter_id = sorted(tenant["aliases"].items())[0]
    for model in (alias, adapter_id, "demo/missing:prod"):
        with pytest.raises(openai.NotFoundError) as exc:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4)
        assert exc.value.code == "model_not_found"
    listed = {m.id for m in client.models.list()}
    assert not listed & set(tenant["aliases"]) and not listed & set(tenant["aliases"].values())
    # the base model is everyone's
    r = client.chat.completions.create(model="lorafarm-dev-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert r.choices[0].message.content is not None


def test_warm_routing_hot_adapter_lands_on_device(farm, tenant, adapter_markers):
    """After warm-up, >= 95% of a hot adapter's requests land on a replica holding it on the device."""
    client = _client(farm, tenant["api_key"])
    alias = sorted(tenant["aliases"])[3]

    def one():
        raw = client.chat.completions.with_raw_response.create(
            model=alias, messages=[{"role": "user", "content": "warm?"}], max_tokens=8, temperature=0
        )
        return raw.headers["x-adapter-tier"], raw.headers.get("x-replica-id"), raw.parse().choices[0].message.content

    for _ in range(3):
        one()

    def routed_warm() -> bool:  # the router's state polls have seen where the adapter is mounted
        raw = client.chat.completions.with_raw_response.create(
            model=alias, messages=[{"role": "user", "content": "warm?"}], max_tokens=8, temperature=0
        )
        return raw.headers["x-route-class"] == "warm" and raw.headers["x-adapter-tier"] == "gpu"

    wait_for(routed_warm, 30, interval=0.5, what=f"{alias} routed warm", logs=farm["_farm"].logs_dir)
    results = [one() for _ in range(60)]
    on_device = sum(tier == "gpu" for tier, _, _ in results) / len(results)
    print(f"warm routing: {100 * on_device:.1f}% of hot-adapter requests on a device slot; replicas {sorted({r for _, r, _ in results})}")
    assert on_device >= 0.95
    assert all(text == adapter_markers[tenant["aliases"][alias]] for _, _, text in results)


@pytest.fixture
def small_farm(tmp_path, dev_model, canaries):
    """Two replicas with the test hold point on (handler/serving/holds.py)."""
    holds = tmp_path / "holds"
    holds.mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(HOLD_ENV, str(holds))  # the replicas inherit it
        with running(seeded_farm(tmp_path, dev_model, canaries, replicas=2, adapters=4)) as info:
            info["_holds"] = holds
            yield info["_farm"], info


def test_killed_replica_no_request_lost(small_farm):
    """SIGKILL one replica under load: every request that had not started streaming still succeeds
    (failover before the first byte), answered by the surviving replica with the right marker. The
    kill lands mid-generation: on the replica whose engine holds request `held_id` (the hold point)."""
    f, info = small_farm
    tenant = info["tenants"][0]
    markers = info["markers"]
    aliases = sorted(tenant["aliases"])
    held_id = f"hold2-{uuid.uuid4().hex[:16]}"  # held after its 2nd token
    held_file = info["_holds"] / f"{held_id}.held"

    async def run():
        client = AsyncOpenAI(base_url=info["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0, timeout=120)
        results = []

        async def one(i, request_id=None):
            alias = aliases[i % len(aliases)]
            r = await client.chat.completions.create(
                model=alias, messages=[{"role": "user", "content": f"req {i}"}], max_tokens=16, temperature=0,
                extra_headers={"x-request-id": request_id} if request_id else None,
            )
            results.append((alias, r.choices[0].message.content))

        first = [asyncio.create_task(one(i, held_id if i == 0 else None)) for i in range(24)]

        def holder() -> int | bool:  # the pid of the replica holding `held_id`; True: answered unheld
            text = held_file.read_text().strip() if held_file.exists() else ""
            return int(text.split()[0]) if text else first[0].done()

        pid = await wait_until(holder, 60, what=f"request {held_id} held on its replica", logs=f.logs_dir)
        assert not isinstance(pid, bool), "answered before the kill: the hold point did not hold"
        victim = next(name for name, proc in f.procs.items() if proc.pid == pid)
        assert victim.startswith("replica-"), victim
        os.kill(pid, signal.SIGKILL)  # its engine is held mid-generation: no request there has a byte out
        rest = [asyncio.create_task(one(i)) for i in range(24, 64)]
        outcomes = await asyncio.gather(*first, *rest, return_exceptions=True)
        await client.close()
        return results, [o for o in outcomes if isinstance(o, BaseException)]

    results, errors = asyncio.run(run())
    assert errors == []
    assert len(results) == 64
    assert all(text == markers[alias] for alias, text in results)


def test_rate_limit_burst_gets_429_other_tenant_unaffected(farm, tenant):
    """A tenant limited to 1 request/s bursting gets 429 with Retry-After and x-ratelimit-* headers;
    the demo tenant, sending at the same time, is not limited."""

    async def make_tenant():
        async with RegistryClient(farm["registry_url"], farm["admin_token"]) as reg:
            return await reg.create_tenant("bursty", requests_per_s=1)

    bursty = asyncio.run(make_tenant())
    limited = _client(farm, bursty["api_key"])
    other = _client(farm, tenant["api_key"])
    statuses, retry_after, other_ok = [], [], 0
    for _ in range(6):
        try:
            raw = limited.chat.completions.with_raw_response.create(
                model="lorafarm-dev-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            statuses.append(raw.status_code)
        except openai.RateLimitError as e:
            statuses.append(e.status_code)
            retry_after.append(e.response.headers.get("retry-after"))
            assert e.response.headers.get("x-ratelimit-limit-requests")
            assert e.code == "rate_limit_exceeded"
        r = other.chat.completions.create(
            model=sorted(tenant["aliases"])[0], messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        other_ok += r.choices[0].message.content is not None
    assert statuses[0] == 200 and 429 in statuses
    assert all(ra is not None and float(ra) > 0 for ra in retry_after)
    assert other_ok == 6


def test_mixed_farm_routes_by_base_model(tmp_path, dev_model, dev_model_b, canaries):
    """Two replicas serving different base models: /v1/models lists both, and each request reaches
    only a replica that serves its base (adapters trained on base A never go to base B)."""
    farm = seeded_farm(tmp_path, dev_model, canaries, replicas=2, adapters=2)
    farm.extra_bases = {"lorafarm-dev-tiny-b": dev_model_b}
    farm.replica_bases = ["lorafarm-dev-tiny", "lorafarm-dev-tiny-b"]
    with running(farm) as info:
        tenant = info["tenants"][0]
        client = _client(info, tenant["api_key"])
        models = {m.id: m for m in client.models.list()}
        assert {"lorafarm-dev-tiny", "lorafarm-dev-tiny-b"} <= set(models)
        served = []
        for model in ["lorafarm-dev-tiny-b", "lorafarm-dev-tiny", *sorted(tenant["aliases"])] * 4:
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "which base?"}], max_tokens=4, temperature=0
            )
            served.append((model, raw.headers["x-replica-id"]))
        assert {r for m, r in served if m == "lorafarm-dev-tiny-b"} == {"r1"}
        assert {r for m, r in served if m != "lorafarm-dev-tiny-b"} == {"r0"}
