"""Fair scheduling through a real replica (issue 35, item 1): one tenant's four n=16, max_tokens=600
requests hold the batch (64 rows of work on 32); another tenant's streamed requests, through the
official openai client on real HTTP, still get their first token and finish while the attacker's
requests are all in flight and still decoding. Order and counts, never time."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from handler.serving.config import REPLICA_ENGINE, Limits
from tests.handler.conftest_service import (  # noqa: F401 - fixtures
    ReplicaServer,
    make_config,
    service_archives,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def replica(dev_model, service_archives, tmp_path_factory):
    engine = REPLICA_ENGINE.replace(kv_cache_bytes=64 << 20, max_batch=32)
    limits = Limits(rank_limit=16, default_max_tokens=32, max_queued_tokens=0)
    cfg = make_config(dev_model, service_archives, tmp_path_factory.mktemp("replica-fair"), slots=2, engine=engine,
                      limits=limits)
    with ReplicaServer(cfg) as srv:
        yield srv


def victim_client(replica, tenant: str = "victim", **headers) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=300,
                       default_headers={"x-lorafarm-tenant": tenant, **headers})


def metric(text: str, name: str, **labels) -> float | None:
    """The sample of `name` with exactly these labels (in any order), or None."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        base, _, rest = series.partition("{")
        if base != name:
            continue
        got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv) if rest else {}
        if {k: v.strip('"') for k, v in got.items()} == labels:
            return float(value)
    return None


async def test_victim_streams_while_the_attackers_n16_requests_hold_the_batch(replica):
    eng = replica.engine
    http = httpx.AsyncClient(timeout=300)
    attack = [
        asyncio.ensure_future(http.post(f"{replica.url}/v1/chat/completions", headers={"x-lorafarm-tenant": "attacker"},
                                        json={"model": "dev-tiny", "n": 16, "max_tokens": 600, "temperature": 0,
                                              "ignore_eos": True,
                                              "messages": [{"role": "user", "content": f"write a long story {j}"}]}))
        for j in range(4)]
    try:
        # the attack holds the batch: 32 rows decoding, 32 more choices queued
        assert await wait_until(lambda: eng.stats().running == 32 and eng.stats().waiting == 32, timeout=120)
        client = victim_client(replica)
        seen = []  # per victim stream, at its first token: (attackers all in flight, attacker rows, victim rows)
        for i in range(5):
            stream = await client.chat.completions.create(
                model="dev-tiny", messages=[{"role": "user", "content": f"where is my parcel {i}"}], max_tokens=8,
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            first, usage, text = None, None, []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:  # its first token's text
                    rows = {a.client: a.held for a in eng.tenant_stats().active}
                    first = (all(not t.done() for t in attack), rows.get("attacker", 0), rows.get("victim", 0))
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    usage = chunk.usage
            assert first is not None and usage is not None and usage.completion_tokens == 8
            seen.append(first)
        # every victim stream got its tokens while all four attacker requests were in flight and the
        # attacker still held the rest of the batch (its share and more: it is alone otherwise)
        assert all(in_flight for in_flight, _, _ in seen), seen
        assert all(att >= 24 for _, att, _ in seen), seen
        assert all(not t.done() for t in attack)
        st, rep = eng.stats(), eng.tenant_stats()
        assert st.preemptions_share >= 1 and st.preemptions_kv == 0
        assert rep.named["victim"].generated_tokens == 5 * 8 and rep.named["victim"].queue_count == 5
        assert rep.named["attacker"].generated_tokens > 32  # still progressing
        # a tenant's weight comes with the router's header: the engine's share follows it
        heavy = victim_client(replica, "heavy", **{"x-lorafarm-tenant-weight": "3"})
        stream = await heavy.chat.completions.create(
            model="dev-tiny", messages=[{"role": "user", "content": "a long answer please"}], max_tokens=300,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                active = {a.client: a for a in eng.tenant_stats().active}
                assert active["heavy"].weight == 3.0 and active["heavy"].share == 24.0
                break
        await stream.close()
        text = (await http.get(f"{replica.url}/metrics")).text
        assert metric(text, "lorafarm_tenant_generation_tokens_total", tenant="victim") == 40.0
        assert metric(text, "lorafarm_tenant_queue_time_seconds_count", tenant="victim") == 5.0
        assert metric(text, "lorafarm_preemptions_total", reason="share") >= 1
        assert metric(text, "lorafarm_tenant_preemptions_total", tenant="attacker", reason="share") >= 1
        assert metric(text, "lorafarm_tenant_rows", tenant="attacker") >= 24
        assert metric(text, "lorafarm_tenant_fair_counter", tenant="attacker") > 0
        assert metric(text, "lorafarm_fair_tenants_active") >= 1
    finally:
        for t in attack:
            t.cancel()
        await asyncio.gather(*attack, return_exceptions=True)
        await http.aclose()
    # the client went away: every choice of the attack leaves the engine
    assert await wait_until(lambda: not eng.has_work(), timeout=60)
    assert eng.stats().kv_cache_usage == 0.0
