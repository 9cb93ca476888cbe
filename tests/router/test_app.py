"""The router end to end against stand-in registry and replicas (tests/router/doubles.py), through
real uvicorn servers on 127.0.0.1 and the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest

from tests.router.conftest import router_farm, wait_for
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

MSG = [{"role": "user", "content": "hello"}]


def _replicas(farm) -> dict:
    """replica id -> what the router's view knows of it now."""
    return {r.replica_id: r for r in farm.core.view.snapshot().replicas}


async def _setup_acme(farm, name="support", base="dev-a"):
    key = farm.registry.add_tenant("acme")
    aid = farm.registry.add_adapter("acme", name, base, alias=f"acme/{name}:prod")
    await farm.sync()
    return key, aid


async def test_non_stream_stream_and_usage_chunk():
    async with router_farm() as farm:
        key, aid = await _setup_acme(farm)
        client = farm.client(key)
        raw = await client.chat.completions.with_raw_response.create(model="acme/support:prod", messages=MSG)
        assert raw.headers["x-adapter-id"] == aid
        assert raw.headers["x-adapter-tier"] in ("gpu", "ram", "disk")
        resp = raw.parse()
        assert resp.choices[0].message.content.split(" ")[0].endswith(f":{aid}")
        assert resp.usage.total_tokens == 9

        stream = await client.chat.completions.create(
            model="acme/support:prod", messages=MSG, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert f":{aid} w0 w1 w2 w3" in text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        assert sum(1 for c in chunks if c.usage) == 1

        # legacy completions, streamed, with the adapter id itself as the model
        stream = await client.completions.create(model=aid, prompt="hi", stream=True, max_tokens=8)
        text = "".join([c.choices[0].text async for c in stream])
        assert text.startswith(next(iter(farm.replicas)) [:1])  # from a replica
        # the replica got the adapter id, never the alias, and the admin token (checked by the double)
        assert all(r["model"] == aid for rep in farm.replicas.values() for r in rep.requests)


async def test_sse_passes_through_unbuffered():
    # the replica sends its next word only after the client has received the previous one: a router that
    # buffered (whole answer, or more than one event) would never deliver it, and the wait below would end
    # the test instead of the stream. Events, not a stopwatch: holds on a busy box.
    gate = asyncio.Semaphore(0)
    async with router_farm(replica_kw={"chunks": 3, "chunk_gate": gate}) as farm:
        key, aid = await _setup_acme(farm)
        words = []

        async def read_stream():
            async with httpx.AsyncClient(timeout=None) as http:
                body = {"model": "acme/support:prod", "messages": MSG, "stream": True}
                async with http.stream("POST", farm.url + "/v1/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and line != "data: [DONE]":
                            content = json.loads(line[5:])["choices"][0]["delta"].get("content")
                            if content:
                                words.append(content)
                                gate.release()  # lets the replica send the next word

        await asyncio.wait_for(read_stream(), timeout=120)
        assert len(words) == 4 and [w.strip() for w in words[1:]] == ["w0", "w1", "w2"]


async def test_errors_are_openai_errors():
    async with router_farm() as farm:
        key, aid = await _setup_acme(farm)
        with pytest.raises(openai.AuthenticationError) as exc:
            await farm.client("wrong-key").chat.completions.create(model="acme/support:prod", messages=MSG)
        assert exc.value.code == "invalid_api_key"
        client = farm.client(key)
        with pytest.raises(openai.NotFoundError) as exc:
            await client.chat.completions.create(model="acme/nosuch:prod", messages=MSG)
        assert exc.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="acme/support:prod", messages=[])
        assert exc.value.body["param"] == "messages"
        async with httpx.AsyncClient() as http:
            r = await http.post(farm.url + "/v1/chat/completions", content=b"{nope",
                                headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            r = await http.get(farm.url + "/v1/nothing")
            assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = await http.get(farm.url + "/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await http.get(farm.url + "/health")
            assert r.status_code == 200 and r.json()["replicas_healthy"] == 2
            r = await http.get(farm.url + "/metrics")
            assert "lorafarm_router_requests_total" in r.text
        # every replica down: 503 as an OpenAI error, not a hang
        for rid in list(farm.replicas):
            await farm.kill(rid)
        with pytest.raises(openai.InternalServerError) as exc:
            await client.chat.completions.create(model="acme/support:prod", messages=MSG)
        assert exc.value.status_code == 503 and exc.value.code == "replica_unavailable"


async def test_warm_routing_hot_adapter_lands_on_gpu(record_property):
    replicas = [(f"r{i}", "dev-a") for i in range(4)]
    async with router_farm(replicas=replicas, replica_kw={"gpu_slots": 4}) as farm:
        key = farm.registry.add_tenant("acme")
        hot = farm.registry.add_adapter("acme", "hot", "dev-a", alias="acme/hot:prod")
        cold = [farm.registry.add_adapter("acme", f"c{i}", "dev-a", alias=f"acme/c{i}:prod") for i in range(30)]
        await farm.sync()
        client = farm.client(key)

        async def one(model):
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=MSG, max_tokens=8)
            return raw.headers["x-adapter-tier"], raw.headers["x-replica-id"], model

        # warm-up: a few hot requests, then let one state poll land (the router sees it on a GPU)
        for _ in range(3):
            await one("acme/hot:prod")
        await wait_for(lambda: any(hot in r.gpu_adapters for r in _replicas(farm).values()), 10)
        # measured phase: 80% hot, 20% spread over 30 cold adapters that churn the 4-slot GPUs
        import random

        rng = random.Random(7)
        models = ["acme/hot:prod" if rng.random() < 0.8 else f"acme/c{rng.randrange(30)}:prod" for _ in range(300)]
        results = []
        for i in range(0, len(models), 6):
            results += await asyncio.gather(*(one(m) for m in models[i : i + 6]))
        hot_results = [r for r in results if r[2] == "acme/hot:prod"]
        gpu = sum(1 for r in hot_results if r[0] == "gpu")
        ratio = gpu / len(hot_results)
        record_property("warm_hit_ratio", ratio)
        print(f"\nwarm routing: {gpu}/{len(hot_results)} = {ratio:.1%} of hot-adapter requests hit a GPU-warm replica")
        assert ratio >= 0.95
        assert cold  # silence linters


async def test_random_strategy_exists_for_ab_and_is_worse():
    replicas = [(f"r{i}", "dev-a") for i in range(4)]
    async with router_farm(replicas=replicas, strategy="random", affinity=False, replica_kw={"gpu_slots": 2}) as farm:
        key = farm.registry.add_tenant("acme")
        for i in range(6):
            farm.registry.add_adapter("acme", f"a{i}", "dev-a", alias=f"acme/a{i}:prod")
        await farm.sync()
        client = farm.client(key)
        tiers = []
        for i in range(60):
            raw = await client.chat.completions.with_raw_response.create(model=f"acme/a{i % 6}:prod", messages=MSG)
            tiers.append(raw.headers["x-adapter-tier"])
        assert {r["model"] for rep in farm.replicas.values() for r in rep.requests}  # spread
        assert sum(1 for rep in farm.replicas.values() if rep.requests) >= 3
        assert tiers.count("gpu") / len(tiers) < 0.9


async def test_score_setting_reaches_the_routing_view():
    async with router_farm(score="class-order") as farm:
        await farm.sync()
        assert farm.core.snapshot().score == "class-order"


async def test_possibly_warm_replica_keeps_traffic():
    async with router_farm(replicas=[("r0", "dev-a"), ("r1", "dev-a"), ("r2", "dev-a")]) as farm:
        key, aid = await _setup_acme(farm)
        # the replica that is not an owner holds the adapter: only its state report brings traffic there
        from lorafarm.rendezvous import owners

        own = owners(aid, ["r0", "r1", "r2"], 2)
        warm = next(r for r in ["r0", "r1", "r2"] if r not in own)
        farm.replicas[warm].warm(aid)
        await farm.sync()
        client = farm.client(key)
        raw = await client.chat.completions.with_raw_response.create(model="acme/support:prod", messages=MSG)
        assert raw.headers["x-replica-id"] == warm and raw.headers["x-route-class"] == "warm"
        # its /state now fails, /health still answers: possibly warm, still routed to
        farm.replicas[warm].state_fails = True
        await wait_for(lambda: not _replicas(farm)[warm].state_fresh, 10)  # its next poll failed
        snap = _replicas(farm)
        assert not snap[warm].state_fresh and snap[warm].healthy
        before = len(farm.replicas[warm].requests)
        for _ in range(10):
            raw = await client.chat.completions.with_raw_response.create(model="acme/support:prod", messages=MSG)
            assert raw.headers["x-replica-id"] == warm
        assert len(farm.replicas[warm].requests) == before + 10
        # health fails too: out of routing after 3 failed checks, traffic moves to the owners
        farm.replicas[warm].health_fails = True
        await wait_for(lambda: not _replicas(farm)[warm].healthy, 3)
        raw = await client.chat.completions.with_raw_response.create(model="acme/support:prod", messages=MSG)
        assert raw.headers["x-replica-id"] in own


async def test_kill_replica_before_first_byte_fails_over():
    async with router_farm(replicas=[("r0", "dev-a"), ("r1", "dev-a"), ("r2", "dev-a")]) as farm:
        key, aid = await _setup_acme(farm)
        client = farm.client(key)
        raw = await client.chat.completions.with_raw_response.create(model="acme/support:prod", messages=MSG)
        first = raw.headers["x-replica-id"]
        await farm.sync()
        await farm.kill(first)  # the router still believes it is warm
        ok = 0
        for stream in (False, True, False, True):
            raw = await client.chat.completions.with_raw_response.create(
                model="acme/support:prod", messages=MSG, stream=stream
            )
            assert raw.headers["x-replica-id"] != first
            if stream:
                chunks = [c async for c in raw.parse()]
                assert chunks
            ok += 1
        assert ok == 4
        # replica dies after sending headers but before the first byte: failed over as well
        second = raw.headers["x-replica-id"]
        farm.replicas[second].fail_before_first_byte = 1
        stream = await client.chat.completions.create(model="acme/support:prod", messages=MSG, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert "w3" in text
        # a 503 answer before the first byte (non-streamed) also moves on
        farm.replicas[second].fail_before_first_byte = 1
        resp = await client.chat.completions.create(model="acme/support:prod", messages=MSG)
        assert "w3" in resp.choices[0].message.content
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(farm.url + "/metrics")).text
        assert "lorafarm_router_failovers_total" in metrics


async def test_mid_stream_failure_ends_with_error_event():
    async with router_farm(replicas=[("r0", "dev-a")], replica_kw={"fail_after_chunks": 2}) as farm:
        key, aid = await _setup_acme(farm)
        client = farm.client(key)
        stream = await client.chat.completions.create(model="acme/support:prod", messages=MSG, stream=True)
        got = []
        with pytest.raises(openai.APIError) as exc:
            async for c in stream:
                got.append(c)
        assert len(got) == 3  # role chunk + 2 pieces: what was sent, then an error, not silence
        assert "mid-stream" in exc.value.message
        async with httpx.AsyncClient(timeout=10) as http:
            body = {"model": "acme/support:prod", "messages": MSG, "stream": True}
            r = await http.post(farm.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            events = [line for line in r.text.splitlines() if line.startswith("data:")]
            assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


async def test_mixed_farm_two_base_models():
    async with router_farm(replicas=[("a0", "dev-a"), ("a1", "dev-a"), ("b0", "dev-b")]) as farm:
        key = farm.registry.add_tenant("acme")
        ad_a = farm.registry.add_adapter("acme", "on-a", "dev-a", alias="acme/on-a:prod")
        ad_b = farm.registry.add_adapter("acme", "on-b", "dev-b", alias="acme/on-b:prod")
        await farm.sync()
        client = farm.client(key)
        models = {m.id: m for m in (await client.models.list()).data}
        assert {"dev-a", "dev-b", "acme/on-a:prod", "acme/on-b:prod"} <= set(models)
        assert models["acme/on-b:prod"].model_extra["parent"] == "dev-b"
        for _ in range(6):
            for model in ("dev-a", "dev-b", "acme/on-a:prod", "acme/on-b:prod"):
                await client.chat.completions.create(model=model, messages=MSG)
        a_models = {r["model"] for rid in ("a0", "a1") for r in farm.replicas[rid].requests}
        b_models = {r["model"] for r in farm.replicas["b0"].requests}
        assert a_models == {"dev-a", ad_a} and b_models == {"dev-b", ad_b}


async def test_rate_limit_burst_429_other_tenant_unaffected():
    async with router_farm() as farm:
        noisy = farm.registry.add_tenant("noisy", requests_per_s=3)
        calm = farm.registry.add_tenant("calm", requests_per_s=3)
        farm.registry.add_adapter("noisy", "x", "dev-a", alias="noisy/x:prod")
        farm.registry.add_adapter("calm", "y", "dev-a", alias="calm/y:prod")
        await farm.sync()
        nc, cc = farm.client(noisy), farm.client(calm)

        async def call(client, model):
            try:
                raw = await client.chat.completions.with_raw_response.create(model=model, messages=MSG)
                return raw.http_response.status_code, raw.headers
            except openai.RateLimitError as e:
                return 429, e.response.headers

        burst = await asyncio.gather(*(call(nc, "noisy/x:prod") for _ in range(12)))
        statuses = [s for s, _ in burst]
        # a bucket of 3 (refilling 3/s: a slow machine may let one more in while the burst arrives)
        assert 3 <= statuses.count(200) <= 4 and statuses.count(429) == 12 - statuses.count(200)
        limited = next(h for s, h in burst if s == 429)
        assert int(limited["retry-after"]) >= 1
        assert limited["x-ratelimit-limit-requests"] == "3"
        assert limited["x-ratelimit-remaining-requests"] == "0"
        assert "x-ratelimit-reset-requests" in limited
        calm_results = [await call(cc, "calm/y:prod") for _ in range(3)]
        assert [s for s, _ in calm_results] == [200, 200, 200]
        await asyncio.sleep(0.5)  # refilled at least one request
        assert (await call(nc, "noisy/x:prod"))[0] == 200


async def test_tenant_isolation():
    async with router_farm() as farm:
        key_a = farm.registry.add_tenant("alpha")
        key_b = farm.registry.add_tenant("bravo")
        aid = farm.registry.add_adapter("alpha", "secret", "dev-a", alias="alpha/secret:prod")
        await farm.sync()
        b = farm.client(key_b)
        errors = []
        for model in ("alpha/secret:prod", aid, "alpha/none:prod", "ad-ffffffffffffffffffff"):
            with pytest.raises(openai.NotFoundError) as exc:
                await b.chat.completions.create(model=model, messages=MSG)
            assert exc.value.code == "model_not_found"
            errors.append(exc.value.message.replace(model, "M"))
        assert len(set(errors)) == 1  # existing or not, the same answer
        assert "alpha/secret:prod" not in {m.id for m in (await b.models.list()).data}
        assert all(not rep.requests for rep in farm.replicas.values())
        resp = await farm.client(key_a).chat.completions.create(model="alpha/secret:prod", messages=MSG)
        assert resp.choices


async def test_alias_deploy_and_rollback_seen_within_a_poll(record_property):
    async with router_farm(routing_poll_interval=1.0) as farm:
        key, v1 = await _setup_acme(farm)
        v2 = farm.registry.add_adapter("acme", "support-v2", "dev-a")
        client = farm.client(key)

        async def current():
            raw = await client.chat.completions.with_raw_response.create(model="acme/support:prod", messages=MSG)
            return raw.headers["x-adapter-id"]

        assert await current() == v1
        seen = []
        for target in (v2, v1):  # deploy, then rollback
            farm.registry.set_alias("acme/support:prod", target)
            # the change must be live after the first routing poll that starts after it (counted, not
            # timed: under CPU load a poll can come late, but never may a second one be needed)
            polls_before = farm.registry.routing_calls
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while (got := await current()) != target and farm.registry.routing_calls < polls_before + 2:
                await asyncio.sleep(0.02)
            seen.append(loop.time() - t0)
            if got != target:  # poll polls_before+1 has been applied once poll +2 has started
                got = await current()
            assert got == target, f"alias still old after {farm.registry.routing_calls - polls_before} polls"
        record_property("alias_seen_s", seen)
        print(f"\nalias deploy seen after {seen[0]:.2f} s, rollback after {seen[1]:.2f} s (poll 1.0 s)")


async def test_stats_pushed_and_slo_tracked(caplog):
    async with router_farm(
        replicas=[("r0", "dev-a")],
        replica_kw={"first_token_delay": 0.06},
        slo_ttft_target=0.05,
        slo_min_samples=3,
        slo_eval_interval=0.1,
    ) as farm:
        key, aid = await _setup_acme(farm)
        client = farm.client(key)
        with caplog.at_level(logging.INFO, logger="lorafarm.router"):
            for _ in range(4):
                stream = await client.chat.completions.create(model="acme/support:prod", messages=MSG, stream=True)
                _ = [c async for c in stream]
            await wait_for(lambda: sum(a["requests"] for s in farm.registry.stats for a in s["adapters"]) >= 4, 30)
            # the SLO evaluation (every 0.1 s) has logged the breach
            await wait_for(lambda: any("tenant acme TTFT p95" in m and "above" in m for m in caplog.messages), 30)
        rows = [a for s in farm.registry.stats for a in s["adapters"]]
        assert {a["adapter_id"] for a in rows} == {aid}
        assert sum(a["requests"] for a in rows) == 4
        assert sum(a["gpu_hits"] for a in rows) == 3  # the first one loaded it
        assert all(0.05 < s["window_s"] < 5 for s in farm.registry.stats)  # the measured window
        assert any(f"adapter_id={aid}" in m for m in caplog.messages), caplog.messages  # access log names the adapter
        assert any("tenant acme TTFT p95" in m and "above" in m for m in caplog.messages)
        async with httpx.AsyncClient() as http:
            text = (await http.get(farm.url + "/metrics")).text
        assert 'lorafarm_router_tenant_ttft_slo_breached{tenant="acme"} 1.0' in text
        assert 'lorafarm_router_time_to_first_token_seconds_count{route_class="warm",tier="gpu"}' in text
        assert 'lorafarm_router_e2e_request_latency_seconds_count{route_class="owner",tier="disk"} 1.0' in text


async def test_cli_starts_the_router_as_a_subprocess(tmp_path):
    """`lorafarm router --port P --registry URL` (admin token from LORAFARM_ADMIN_TOKEN)."""
    import os
    import socket
    import subprocess
    import sys

    from tests.router.doubles import ADMIN_TOKEN

    async with router_farm(replicas=[("r0", "dev-a")]) as farm:
        key, aid = await _setup_acme(farm)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(tmp_path / "router.log", "wb")
        env = {**os.environ, "LORAFARM_ADMIN_TOKEN": ADMIN_TOKEN}
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorafarm", "router", "--port", str(port), "--registry", farm.registry_served.url,
             "--poll-interval", "0.2"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient() as http:

                async def healthy() -> bool:
                    # refused while it starts: not yet
                    return (await http.get(url + "/health")).status_code == 200

                await wait_until(healthy, 30, interval=0.05, what=f"the router healthy at {url}",
                                 logs=tmp_path / "router.log")
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            raw = await client.chat.completions.with_raw_response.create(model="acme/support:prod", messages=MSG)
            assert raw.headers["x-adapter-id"] == aid
        finally:
            proc.terminate()
            assert proc.wait(timeout=15) == 0
        assert f"adapter_id={aid}" in (tmp_path / "router.log").read_text()


async def test_a_hung_replica_does_not_slow_the_others_polls():
    # r1 answers its state polls after 5 s: while r0 is polled 5 times (~0.5 s on an idle box, a few
    # seconds on a busy one) r1 is polled once, maybe twice, never once per r0 poll
    async with router_farm(replicas=[("r0", "dev-a"), ("r1", "dev-a")], state_timeout=10.0) as farm:
        r0, r1 = farm.replicas["r0"], farm.replicas["r1"]
        r1.state_delay = 5.0
        r0_before, r1_before = r0.state_calls, r1.state_calls
        await wait_for(lambda: r0.state_calls - r0_before >= 5, timeout=60)
        assert r1.state_calls - r1_before <= 2  # one poll at a time, not piling up, not holding r0's


async def test_client_leaving_mid_stream_cancels_upstream():
    async with router_farm(replicas=[("r0", "dev-a")], replica_kw={"chunks": 20, "chunk_delay": 0.1}) as farm:
        key, aid = await _setup_acme(farm)
        rep = farm.replicas["r0"]
        async with httpx.AsyncClient(timeout=10) as http:
            body = {"model": "acme/support:prod", "messages": MSG, "stream": True}
            async with http.stream("POST", farm.url + "/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
                async for _ in r.aiter_lines():
                    break
                assert rep.running == 1
        # the router closed its upstream request: the replica stops generating long before 2 s
        await wait_for(lambda: rep.running == 0, timeout=1.5)
        await wait_for(lambda: farm.core.view.replicas["r0"].local_connections == 0, timeout=1.0)
        async with httpx.AsyncClient() as http:
            text = (await http.get(farm.url + "/metrics")).text
        assert 'status="client_closed"' in text


async def test_registry_outage_keeps_serving_known_tenants():
    async with router_farm() as farm:
        key, aid = await _setup_acme(farm)
        other = farm.registry.add_tenant("other")
        client = farm.client(key)
        await client.chat.completions.create(model="acme/support:prod", messages=MSG)  # key now cached
        farm.registry.down = True
        # routing polls fail: the last table stays in use
        await wait_for(lambda: not farm.core.health()[1]["registry_reachable"], 10)
        resp = await client.chat.completions.create(model="acme/support:prod", messages=MSG)
        assert resp.choices
        with pytest.raises(openai.InternalServerError) as exc:  # an unseen key cannot be checked: 503, not 401
            await farm.client(other).chat.completions.create(model="acme/support:prod", messages=MSG)
        assert exc.value.status_code == 503 and exc.value.code == "auth_unavailable"
        async with httpx.AsyncClient() as http:
            assert (await http.get(farm.url + "/health")).status_code == 200
        farm.registry.down = False


async def test_health_is_503_until_the_first_routing_table():
    from router.app import create_app
    from router.config import RouterSettings
    from tests.router.doubles import ADMIN_TOKEN, FakeRegistry, serve

    registry = FakeRegistry(down=True)
    async with serve(registry.app()) as reg:
        settings = RouterSettings(registry_url=reg.url, admin_token=ADMIN_TOKEN, routing_poll_interval=0.1,
                                  poll_interval=0.1, registry_timeout=0.5)  # fmt: skip
        async with serve(create_app(settings)) as router:
            async with httpx.AsyncClient() as http:
                r = await http.get(router.url + "/health")
                assert r.status_code == 503 and r.json()["status"] == "starting"
                registry.down = False

                async def ready() -> bool:
                    return (await http.get(router.url + "/health")).status_code == 200

                assert await wait_until(ready, 10, what="the router's first routing table")
