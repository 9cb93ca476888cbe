"""Issue 35, items 2-4, on a real replica (uvicorn on 127.0.0.1, real grammar worker processes, real
HTTP): a hostile tenant's large prompts and grammar floods against a victim tenant.

No timing assertions: each check is an order of events (the victim's request completes while the
attacker's work is still queued) or a counter. To make "the attacker's work is still queued"
certain, the attacker's own running slot is held: on the prep threads by a job that blocks until
the test lets it go (standing in for a prompt that takes seconds to tokenize), on the grammar
workers by a compile that hangs (the test-only grammar fault, read by the worker processes only)."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import httpx
import pytest

from handler.grammar.pool import FAULT_ENV, FAULT_TITLE
from tests.handler.conftest_service import ReplicaServer
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(900)

MAX_WAITING = 16  # the replica's grammar_max_waiting here (the default tenant cap is 16 too)


@pytest.fixture(scope="module")
def replica(dev_model, tmp_path_factory):
    from handler.serving.config import REPLICA_ENGINE, Limits, ReplicaConfig

    old = os.environ.get(FAULT_ENV)
    os.environ[FAULT_ENV] = "hang"  # inherited by the grammar workers (and their replacements)
    cfg = ReplicaConfig(base_dir=dev_model, replica_id="rf", model_name="dev-tiny",
                        disk_dir=tmp_path_factory.mktemp("replica-fair"),
                        engine=REPLICA_ENGINE.replace(kv_cache_bytes=8 * 1024 * 1024),
                        limits=Limits(default_max_tokens=8, grammar_timeout_s=600, grammar_max_waiting=MAX_WAITING))
    try:
        with ReplicaServer(cfg) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop(FAULT_ENV, None)
        else:
            os.environ[FAULT_ENV] = old


def on_loop(srv, fn):
    """`fn()` run on the replica's event loop (its queues are the loop's: read them there)."""
    h = srv.service.handler

    async def call():
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), h._loop).result(60)


async def until(pred, what: str, deadline_s: float = 300.0) -> None:
    """Wait for a state (the deadline is only against a hang: nothing here is timed); `pred` blocks
    on HTTP, so it runs in a thread while the test's other tasks go on."""
    await wait_until(lambda: asyncio.to_thread(pred), deadline_s, what=what)


def chat(content: str = "a user record", **kw) -> dict:
    return {"model": "dev-tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **kw}


def schema(s: dict, name: str = "s") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": s}}


HANG = schema({"title": FAULT_TITLE, "type": "object"})  # holds a grammar worker until its caller leaves


def slow(n: int) -> dict:
    """The issue's flood: distinct schemas that took seconds to refuse (now ~0.2 s, by the lexer fuel)."""
    return schema({"type": "string", "pattern": "^(a{1000}){%d}$" % n})


def victim_schema(i: int) -> dict:
    return schema({"type": "object", "properties": {f"field{i}": {"type": "integer"}}, "required": [f"field{i}"]})


async def post(http: httpx.AsyncClient, url: str, tenant: str, body: dict) -> httpx.Response:
    return await http.post(f"{url}/v1/chat/completions", json=body, headers={"x-lorafarm-tenant": tenant})


def pool_stats(srv) -> dict:
    return on_loop(srv, srv.service.handler.grammar_pool.stats)


async def settle_grammar(srv) -> None:
    """Every attacker compile gone and both workers back (a killed worker replaced)."""
    await until(lambda: (lambda st: st["tenants"] == {} and st["waiting"] == 0 and st["alive"] == 2
                         and st["idle"] == 2)(pool_stats(srv)), "the grammar pool idle again")


async def test_a_tenant_looping_huge_prompts_does_not_queue_another_tenants_requests(replica):
    """Item 2: the attacker's 900 KB prompts wait in its own prep queue (8 deep: the rest are 429
    prep_queue_full) while the victim's 18 KB requests are prepared on the other thread and answered;
    then each huge prompt is refused as past the context by its byte bound, never tokenized whole."""
    h = replica.service.handler
    url = replica.url
    gate, started = threading.Event(), threading.Event()

    def tokenizing_for_seconds():  # the attacker's running prep job, until the test lets it go
        started.set()
        gate.wait()

    hold = asyncio.run_coroutine_threadsafe(h._prep.run("attacker", 900 * 1024, tokenizing_for_seconds), h._loop)
    huge = chat("lorem ipsum " * 75000)  # ~900 KB: past the dev model's 2,048-token context
    small = chat("a short question", user="u" * 18000)  # an 18 KB body (over the 16 KiB inline limit)
    assert len(json.dumps(small)) > 18000
    refused_before = h.token_bound.refused
    prep = lambda: on_loop(replica, h._prep.stats)  # noqa: E731
    try:
        await asyncio.to_thread(started.wait, 120)
        async with httpx.AsyncClient(timeout=600) as http:
            attack = [asyncio.ensure_future(post(http, url, "attacker", huge)) for _ in range(12)]
            await until(lambda: prep()["tenants"].get("attacker", {}).get("waiting") == 8
                        and sum(t.done() for t in attack) == 4, "8 huge prompts queued, 4 refused")
            full = [t.result() for t in attack if t.done()]
            assert all(r.status_code == 429 and r.json()["error"]["code"] == "prep_queue_full" for r in full)
            for i in range(10):
                r = await post(http, url, "victim", small)
                assert r.status_code == 200, r.text
                # answered while the attacker's whole backlog still waits behind its own running job
                assert prep()["tenants"]["attacker"] == {"waiting": 8, "running": 1}, i
            assert not hold.done()
            gate.set()
            await asyncio.gather(*attack)
            answers = [t.result() for t in attack if t.result().status_code != 429]
            assert len(answers) == 8
            for r in answers:
                err = r.json()["error"]
                assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
                assert err["param"] == "messages" and "at least" in err["message"]
        assert h.token_bound.refused - refused_before == 8  # each refused before it was tokenized whole
        assert prep()["tenants"] == {}
    finally:
        gate.set()
        hold.result(60)


async def test_a_grammar_flood_never_refuses_another_tenant_and_stops_when_the_attacker_leaves(replica):
    """Item 3: the attacker holds its worker slot and floods distinct slow-to-refuse schemas: 16 wait
    (its own cap; the replica's whole waiting cap here is 16 too, so the old global count refused
    everyone else), the rest are 429 grammar_queue_full. The victim's 10 new-schema requests all get
    200 meanwhile. Once the attacker hangs up, its queued compiles are dropped, the hanging one's
    worker killed and replaced, and none of its queued schemas was ever compiled."""
    h = replica.service.handler
    url = replica.url
    await settle_grammar(replica)
    compiles0 = h.grammar_pool.compiles
    cancelled0 = h.grammar_pool.cancelled
    async with httpx.AsyncClient(timeout=600) as attacker_http, httpx.AsyncClient(timeout=600) as http:
        hold = asyncio.ensure_future(post(attacker_http, url, "attacker", chat(response_format=HANG)))
        await until(lambda: pool_stats(replica)["tenants"].get("attacker") == {"waiting": 0, "running": 1},
                    "the attacker holds a worker")
        flood = [asyncio.ensure_future(post(attacker_http, url, "attacker", chat(response_format=slow(300 + i))))
                 for i in range(24)]
        await until(lambda: pool_stats(replica)["waiting"] == MAX_WAITING and sum(t.done() for t in flood) == 8,
                    "16 queued, 8 refused")
        for t in flood:
            if t.done():
                r = t.result()
                assert r.status_code == 429 and r.json()["error"]["code"] == "grammar_queue_full", r.text
        for i in range(10):
            r = await post(http, url, "victim", chat(response_format=victim_schema(i)))
            assert r.status_code == 200, r.text
            st = pool_stats(replica)
            assert st["tenants"]["attacker"] == {"waiting": MAX_WAITING, "running": 1}, st
        assert not hold.done()
        metrics = (await http.get(f"{url}/metrics")).text  # the per-tenant depths, where an operator looks
        assert f'lorafarm_tenant_queue_waiting{{queue="grammar",tenant="attacker"}} {MAX_WAITING}.0' in metrics
        assert 'lorafarm_tenant_queue_running{queue="grammar",tenant="attacker"} 1.0' in metrics
        assert 'lorafarm_tenant_queue_refused_total{queue="grammar"}' in metrics
        # the attacker hangs up
        for t in [hold, *flood]:
            t.cancel()
        await asyncio.gather(hold, *flood, return_exceptions=True)
    await settle_grammar(replica)
    assert h.grammar_pool.cancelled - cancelled0 == 1 + MAX_WAITING
    assert h.grammar_pool.compiles - compiles0 == 1 + 10  # the hang and the victim's: no queued schema ran
    assert h._grammar_inflight == {}
    async with httpx.AsyncClient(timeout=600) as http:  # the attacker's slot is free again
        r = await post(http, url, "attacker", chat(response_format=victim_schema(100)))
        assert r.status_code == 200, r.text


async def test_an_attackers_queue_never_delays_a_victims_schema(replica):
    """Item 4: the attacker queues slow schemas behind its worker slot, then sends the schema the
    victim uses. The victim's request is not shared with the attacker's (still waiting in the
    attacker's queue): it compiles on its own and is answered, then served from the cache."""
    h = replica.service.handler
    url = replica.url
    await settle_grammar(replica)
    shared = victim_schema(7777)
    async with httpx.AsyncClient(timeout=600) as attacker_http, httpx.AsyncClient(timeout=600) as http:
        hold = asyncio.ensure_future(post(attacker_http, url, "attacker", chat(response_format=HANG)))
        await until(lambda: pool_stats(replica)["tenants"].get("attacker") == {"waiting": 0, "running": 1},
                    "the attacker holds a worker")
        queued = [asyncio.ensure_future(post(attacker_http, url, "attacker", chat(response_format=slow(500 + i))))
                  for i in range(3)]
        await until(lambda: pool_stats(replica)["waiting"] == 3, "3 slow schemas queued")
        theirs = asyncio.ensure_future(post(attacker_http, url, "attacker", chat(response_format=shared)))
        await until(lambda: pool_stats(replica)["waiting"] == 4, "the victim's schema queued by the attacker")
        compiles = h.grammar_pool.compiles
        r = await post(http, url, "victim", chat(response_format=shared))
        assert r.status_code == 200, r.text
        assert not theirs.done() and pool_stats(replica)["tenants"]["attacker"] == {"waiting": 4, "running": 1}
        assert h.grammar_pool.compiles == compiles + 1  # the victim's own compile
        async with http.stream("POST", f"{url}/v1/chat/completions", json=chat(response_format=shared, stream=True),
                               headers={"x-lorafarm-tenant": "victim"}) as s:
            assert s.status_code == 200
            assert [ln async for ln in s.aiter_lines() if ln.startswith("data: ")][-1] == "data: [DONE]"
        assert h.grammar_pool.compiles == compiles + 1  # then from the cache
        for t in [hold, *queued, theirs]:
            t.cancel()
        await asyncio.gather(hold, *queued, theirs, return_exceptions=True)
    await settle_grammar(replica)
