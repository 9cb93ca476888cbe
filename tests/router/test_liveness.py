"""The router's failover when replicas die, poison requests, liveness of slow streams, deadlines and
overload shedding (issues 21 and 26), against real servers on 127.0.0.1: the real router in front of
stand-in replicas (tests/router/doubles.py), among them `DyingReplica`, whose process "dies" (every
connection reset, the port closed) when a request body carries its poison."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest

from tests.router.conftest import router_farm, wait_for
from router.proxy import UPSTREAM_KEEPALIVE_S, make_http_client
from tests.router.doubles import DyingReplica, ResettingServer

pytestmark = pytest.mark.timeout(60)

MSG = [{"role": "user", "content": "hello"}]
POISON = [{"role": "user", "content": "POISON: a body that kills every replica it reaches"}]


async def _dying_farm(farm, n: int, **kw) -> list[DyingReplica]:
    reps = []
    for i in range(n):
        rep = await DyingReplica(f"d{i}", **kw).start()
        farm.registry.add_replica(rep.replica_id, rep.url, "dev-a")
        farm.replica_served[rep.replica_id] = rep
        reps.append(rep)
    await farm.sync()
    return reps


def _count(farm, name: str, **labels) -> float:
    v = farm.core.metrics.registry.get_sample_value(name, labels)
    return v or 0.0


async def _chat(http, farm, key, messages, **extra):
    return await http.post(farm.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}", **extra.pop(
        "headers", {})}, json={"model": "dev-a", "messages": messages, "max_tokens": 4, **extra})


async def test_poison_request_kills_at_most_two_replicas_then_is_refused(caplog):
    """A body that kills every replica it reaches: the first replica dies, the request is sent to one
    more (which dies too), then it is answered 400 poison_request; sent again, it is refused before
    any replica sees it. The third replica never sees it and keeps serving; metrics and log say so."""
    caplog.set_level(logging.WARNING, logger="lorafarm.router")
    async with router_farm(replicas=()) as farm:
        key = farm.registry.add_tenant("acme")
        reps = await _dying_farm(farm, 3)
        async with httpx.AsyncClient(timeout=20) as http:
            r = await _chat(http, farm, key, POISON, headers={"x-request-id": "poison-1"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "poison_request"
            died = sorted(rep.replica_id for rep in reps if rep.hits)
            # the message says what was seen: the two replicas by name, and no completion since
            assert f"in flight when replicas {died[0]} and {died[1]} died" in r.json()["error"]["message"] or \
                f"in flight when replicas {died[1]} and {died[0]} died" in r.json()["error"]["message"]
            assert "has not completed on any replica since" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) > 0
            hit = [rep for rep in reps if rep.hits]
            assert len(hit) == 2 and all(rep.dead.is_set() and len(rep.hits) == 1 for rep in hit)
            survivor = next(rep for rep in reps if not rep.hits)

            # the same body again (streamed this time: the same fingerprint): refused, no replica hit
            r = await _chat(http, farm, key, POISON, stream=True, headers={"x-request-id": "poison-2"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "poison_request"
            assert survivor.hits == [] and not survivor.dead.is_set()

            # other requests are served by the survivor
            r = await _chat(http, farm, key, MSG)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith(survivor.replica_id)
        m = "lorafarm_router_poison_requests_total"
        assert _count(farm, m, outcome="stopped") == 1 and _count(farm, m, outcome="refused") == 1
        assert _count(farm, "lorafarm_router_replica_deaths_total", phase="before_first_byte") == 2
    logged = [rec.getMessage() for rec in caplog.records if "poison request" in rec.getMessage()]
    assert any("request_id=poison-1 tenant=acme" in m and "stopped" in m for m in logged)
    assert any("request_id=poison-2 tenant=acme" in m and "refused" in m for m in logged)


async def test_strict_mode_loses_at_most_one_replica_to_a_poison_body():
    """`--death-retries 0 --poison-threshold 1`: the replica a poison body reaches first is the only
    one lost; the request and every resend (an OpenAI client's own retries included) get 400."""
    async with router_farm(replicas=(), death_retries=0, poison_threshold=1) as farm:
        key = farm.registry.add_tenant("acme")
        reps = await _dying_farm(farm, 3)
        async with httpx.AsyncClient(timeout=20) as http:
            for _ in range(3):
                r = await _chat(http, farm, key, POISON)
                assert r.status_code == 400 and r.json()["error"]["code"] == "poison_request"
            assert sum(rep.dead.is_set() for rep in reps) == 1 and sum(len(rep.hits) for rep in reps) == 1
            r = await _chat(http, farm, key, MSG)
            assert r.status_code == 200


async def test_after_a_death_a_request_goes_to_one_more_replica_only():
    """The per-request rule alone (threshold raised so the fingerprint does not decide): after the
    replica it was on died, the request reaches at most one more replica; a second death ends it with
    a 502 replica_died, and the third replica is never tried."""
    async with router_farm(replicas=(), poison_threshold=5) as farm:
        key = farm.registry.add_tenant("acme")
        reps = await _dying_farm(farm, 3)
        async with httpx.AsyncClient(timeout=20) as http:
            r = await _chat(http, farm, key, POISON)
        assert r.status_code == 502 and r.json()["error"]["code"] == "replica_died"
        assert sorted(len(rep.hits) for rep in reps) == [0, 1, 1]


async def test_innocent_request_on_a_killed_replica_is_retried_once_and_served():
    """A replica killed (not by the request) while it holds a request: the request is served by the
    next replica, and its body is not refused afterwards (one death is not poison)."""
    async with router_farm(replicas=()) as farm:
        key = farm.registry.add_tenant("acme")
        reps = await _dying_farm(farm, 2)
        kills = {"n": 1}  # whichever replica gets the request first dies with it in flight
        for rep in reps:
            rep.kills = kills
        async with httpx.AsyncClient(timeout=20) as http:
            r = await _chat(http, farm, key, MSG)
            assert r.status_code == 200, r.text
            assert kills["n"] == 0 and sum(rep.dead.is_set() for rep in reps) == 1
            r2 = await _chat(http, farm, key, MSG)
            assert r2.status_code == 200
        assert _count(farm, "lorafarm_router_replica_deaths_total", phase="before_first_byte") == 1
        assert _count(farm, "lorafarm_router_poison_requests_total", outcome="refused") == 0
        assert len(farm.core.proxy.guard) == 0  # it completed on the next replica: its death is forgotten


async def test_two_replicas_crash_with_a_popular_body_that_completes_elsewhere_it_is_not_refused():
    """Issue 35 item 5: one crash each of two replicas, with the same body in flight each time; the
    body completes on another replica after each crash, so it is never refused (before: two deaths,
    refused for ten minutes). Three stand-in replicas: d0 dies, then d1 dies."""
    async with router_farm(replicas=()) as farm:
        key = farm.registry.add_tenant("acme")
        reps = await _dying_farm(farm, 3)
        async with httpx.AsyncClient(timeout=20) as http:
            for victim in range(2):
                live = [rep for rep in reps if not rep.dead.is_set()]
                kills = {"n": 1}  # whichever live replica gets it first dies with it in flight
                for rep in live:
                    rep.kills = kills
                r = await _chat(http, farm, key, MSG)
                assert r.status_code == 200, r.text
                assert kills["n"] == 0 and sum(rep.dead.is_set() for rep in reps) == victim + 1
                for rep in reps:
                    rep.kills = None
                await wait_for(lambda: sum(farm.core.view.is_responsive(rep.replica_id) for rep in reps)
                               == 2 - victim, 10)
            r = await _chat(http, farm, key, MSG)
            assert r.status_code == 200, r.text
        assert _count(farm, "lorafarm_router_replica_deaths_total", phase="before_first_byte") == 2
        assert _count(farm, "lorafarm_router_poison_requests_total", outcome="refused") == 0
        assert _count(farm, "lorafarm_router_poison_requests_total", outcome="stopped") == 0


async def test_one_replica_death_with_copies_of_a_body_in_flight_is_one_death():
    """A replica dies holding three identical requests (a popular prompt): that is one death of the
    body, not three. Every copy is served by the next replica and the body is not refused afterwards
    (counting copies refused it for the whole cooloff after one unrelated crash)."""
    from router.poison import PoisonGuard, fingerprint
    from router.proxy import Proxy, Opened
    from router.routing import RankedReplica, ReplicaSnapshot

    dying, healthy = await DyingReplica("d0").start(), await DyingReplica("d1").start()
    dying.die_holding = 3
    guard = PoisonGuard(threshold=2)
    body = {"model": "dev-a", "messages": MSG, "max_tokens": 4}
    fp = fingerprint("acme", "chat", body)
    ranked = [RankedReplica(ReplicaSnapshot(rep.replica_id, url=rep.url), "base", "warm") for rep in (dying, healthy)]
    try:
        async with make_http_client(16, httpx.Timeout(10.0)) as http:
            proxy = Proxy(http, admin_token=None, guard=guard)

            async def one() -> Opened:
                out = await proxy.open(ranked, "/v1/chat/completions", json.dumps(body).encode(), request_id="r",
                                       tenant_id="acme", read_whole_body=True, fingerprint=fp)
                if isinstance(out, Opened):
                    await out.aclose()
                return out

            outs = await asyncio.wait_for(asyncio.gather(one(), one(), one()), 30)
        assert dying.dead.is_set()  # it died with all three in flight (before the stops below)
    finally:
        await dying.stop()
        await healthy.stop()
    assert len(dying.hits) == 3
    assert [type(o).__name__ for o in outs] == ["Opened"] * 3, [getattr(o, "body", o) for o in outs]
    assert all(o.ranked.replica_id == "d1" and o.status_code == 200 for o in outs)
    assert guard.deaths(fp) == 1 and guard.refused_for(fp) == 0.0


async def test_replica_already_down_is_plain_failover_not_a_death():
    async with router_farm(replicas=()) as farm:
        key = farm.registry.add_tenant("acme")
        reps = await _dying_farm(farm, 2)
        reps[0].die()  # down before the request: its port refuses, nothing is sent
        async with httpx.AsyncClient(timeout=20) as http:
            for _ in range(4):
                r = await _chat(http, farm, key, MSG)
                assert r.status_code == 200
        assert _count(farm, "lorafarm_router_replica_deaths_total", phase="before_first_byte") == 0


def test_replica_resetting_connections_is_no_router_500_under_uvloop():
    """Issue 26: the router answered `500 Internal error` with `AttributeError: 'NoneType' object has
    no attribute 'getpeername'` right after a replica failed. Under uvloop (what `lorafarm router`
    runs on) a connection reset just after the connect leaves a transport with no socket, and httpcore
    asks it for its TLS object (and the pool for readability): anyio raised AttributeError out of
    `send()`. Here a replica resets every connection as it accepts it (from its own thread); the
    router, on uvloop, must fail each attempt over to the good replica: 200s, never a 500. (Without
    the fix about a third of the attempts raised.)"""
    uvloop = pytest.importorskip("uvloop")
    out: dict = {}

    async def scenario():
        # the router's upstream client alone: every attempt on a reset connection is a transport error
        bad = ResettingServer()
        errors: dict[str, int] = {}
        async with make_http_client(64, httpx.Timeout(5.0)) as client:
            for _ in range(60):
                try:
                    await client.post(bad.url + "/v1/chat/completions", content=b"{}")
                except httpx.TransportError as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                except Exception as e:  # noqa: BLE001 - what the bug raised: AttributeError
                    errors[f"BUG {type(e).__name__}: {e}"] = errors.get(f"BUG {type(e).__name__}: {e}", 0) + 1
        await bad.stop()
        out["client_errors"] = errors

        # health_failures high: the resetting replica stays in routing, so every request can meet it
        async with router_farm(replicas=(("good", "dev-a"),), poll_interval=30.0, health_failures=1000,
                               strategy="random") as farm:
            key = farm.registry.add_tenant("acme")
            bad = ResettingServer()
            farm.registry.add_replica("bad", bad.url, "dev-a")
            farm.replica_served["bad"] = bad
            await farm.sync()
            statuses: dict[int, int] = {}
            async with httpx.AsyncClient(timeout=20) as http:
                for i in range(40):
                    r = await _chat(http, farm, key, [{"role": "user", "content": f"q{i}"}])
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            out["statuses"], out["resets"] = statuses, bad.resets

    def run():
        try:
            uvloop.run(scenario())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(50)
    assert "error" not in out, out.get("error")
    assert not [k for k in out["client_errors"] if k.startswith("BUG")], out["client_errors"]
    assert out["statuses"] == {200: 40}
    assert out["resets"] >= 10  # the resetting replica was met, often


async def test_slow_prefill_stream_with_keepalives_survives_a_short_read_timeout():
    """The first token comes 1.5 s after the role chunk; the router's read timeout is 0.5 s. With the
    replica's `: keep-alive` comments the stream is alive and completes (the comments reach the client,
    which ignores them); without them it is cut with an error event."""
    async with router_farm(replicas=(("r0", "dev-a"),), read_timeout=0.5,
                           replica_kw={"first_token_delay": 1.5, "keepalive_interval": 0.2}) as farm:
        key = farm.registry.add_tenant("acme")
        await farm.sync()
        client = farm.client(key)
        stream = await client.chat.completions.create(model="dev-a", messages=MSG, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text.startswith("r0:dev-a w0")
        async with httpx.AsyncClient(timeout=20) as http:
            r = await _chat(http, farm, key, MSG, stream=True)
            assert r.status_code == 200 and ": keep-alive" in r.text and "upstream_error" not in r.text

        farm.replicas["r0"].keepalive_interval = None
        async with httpx.AsyncClient(timeout=20) as http:
            r = await _chat(http, farm, key, MSG, stream=True)
        assert "upstream_error" in r.text and "ReadTimeout" in r.text


async def test_deadline_from_x_request_timeout():
    """A non-streamed request with `x-request-timeout: 0.5` on a replica that needs 3 s: 504
    request_timeout at the deadline, no failover to the other replica; a stream gets an error event."""
    async with router_farm(replica_kw={"first_token_delay": 3.0}) as farm:
        key = farm.registry.add_tenant("acme")
        await farm.sync()
        async with httpx.AsyncClient(timeout=20) as http:
            r = await _chat(http, farm, key, MSG, headers={"x-request-timeout": "0.5"})
            assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
            assert sum(len(rep.requests) for rep in farm.replicas.values()) == 1  # no failover
            r = await _chat(http, farm, key, MSG, stream=True, headers={"x-request-timeout": "0.5"})
            assert r.status_code == 200
            events = [json.loads(ln[5:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            assert events[-1]["error"]["code"] == "request_timeout"
            r = await _chat(http, farm, key, MSG, headers={"x-request-timeout": "soon"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_timeout"
        assert _count(farm, "lorafarm_router_deadline_exceeded_total") == 2


async def test_overloaded_replicas_shed_with_retry_after():
    """Replicas that shed (503 + Retry-After before accepting): the router tries each, then answers
    the client with the replica's 503 and its Retry-After."""
    async with router_farm(replica_kw={"shed": True}) as farm:
        key = farm.registry.add_tenant("acme")
        await farm.sync()
        async with httpx.AsyncClient(timeout=20) as http:
            r = await _chat(http, farm, key, MSG)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "overloaded"
        assert _count(farm, "lorafarm_router_failovers_total", reason="http_503") == 2


def test_router_flags_pass_through_lorafarm_up_and_parse_as_router_flags():
    """`lorafarm up --router-flags '...'` (like --replica-flags): the string is split and handed to
    `lorafarm router`; here both parsers accept it and the router flags land in its settings."""
    import shlex

    from lorafarm.cli import build_parser

    parser = build_parser()
    up = parser.parse_args(["up", "--router-flags", "--read-timeout 30 --death-retries 0 --poison-cooloff 60 "
                            "--non-stream-timeout 120 --max-request-timeout 900 --poison-threshold 3"])
    args = parser.parse_args(["router", *shlex.split(up.router_flags)])
    assert (args.read_timeout, args.death_retries, args.poison_cooloff) == (30.0, 0, 60.0)
    assert (args.non_stream_timeout, args.max_request_timeout, args.poison_threshold) == (120.0, 900.0, 3)


def test_poison_guard_counts_distinct_replicas_per_fingerprint_and_forgets_after_the_cooloff():
    from router.poison import PoisonGuard, fingerprint

    now = [0.0]
    g = PoisonGuard(threshold=2, cooloff=10.0, max_entries=3, clock=lambda: now[0])
    body = {"model": "m", "messages": MSG}
    fp = fingerprint("acme", "chat", body)
    assert fp == fingerprint("acme", "chat", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert fp != fingerprint("other", "chat", body) and fp != fingerprint("acme", "completions", body)
    assert g.record_death(fp, "r0") == 1 and g.refused_for(fp) == 0.0
    now[0] = 5.0
    assert g.record_death(fp, "r1") == 2 and g.refused_for(fp) == 10.0
    now[0] = 14.0
    assert 0 < g.refused_for(fp) <= 1.0
    now[0] = 15.5
    assert g.refused_for(fp) == 0.0 and g.deaths(fp) == 0  # cooled off: forgotten
    for i in range(5):  # bounded: the oldest fingerprints go first
        g.record_death(f"fp{i}", "r0")
    assert len(g) == 3 and g.deaths("fp0") == 0 and g.deaths("fp4") == 1
    # one death named by every request that was in flight on it counts once; so does another death
    # of the same replica (a crash loop): only another replica makes a second
    assert g.record_death("x", "r0", ("r0", 1)) == 1 and g.record_death("x", "r0", ("r0", 1)) == 1
    assert g.record_death("x", "r0", ("r0", 2)) == 1 and g.refused_for("x") == 0.0
    assert g.record_death("x", "r1", ("r1", 1)) == 2 and g.refused_for("x") == 10.0
    assert g.describe("x") == "replicas r0 (twice) and r1"


def test_a_crash_loop_of_one_replica_never_makes_a_body_poison():
    """Item 5 of issue 35: one replica SIGKILLed, restarted and killed again (three times, minutes
    apart) with a popular body in flight each time: it is one replica, never poison."""
    from router.poison import PoisonGuard, fingerprint

    now = [0.0]
    g = PoisonGuard(threshold=2, cooloff=600.0, clock=lambda: now[0])
    fp = fingerprint("acme", "chat", {"model": "m", "messages": [{"role": "user", "content": "Reset my password"}]})
    for death in range(1, 4):
        now[0] += 49.0
        assert g.record_death(fp, "r0", ("r0", death)) == 1
        assert g.refused_for(fp) == 0.0
    assert g.replicas(fp) == {"r0": 3}


def test_a_body_that_completes_anywhere_is_cleared():
    """One crash each of two replicas with a popular body in flight, the body completing elsewhere
    between them: its deaths are forgotten at each completion, so it is never refused; a body that
    never completes (the killer) is refused at the second distinct replica, and a completion (a copy
    already in flight elsewhere) clears even a refusal."""
    from router.poison import PoisonGuard

    g = PoisonGuard(threshold=2)
    assert g.record_death("popular", "r0") == 1
    assert g.completed("popular") and g.deaths("popular") == 0
    assert g.record_death("popular", "r1") == 1 and g.refused_for("popular") == 0.0
    assert not g.completed("never-died")
    assert g.record_death("killer", "r0") == 1 and g.record_death("killer", "r1") == 2
    assert g.refused_for("killer") > 0 and g.describe("killer") == "replicas r0 and r1"
    assert g.completed("killer") and g.refused_for("killer") == 0.0


def test_the_canary_probes_fixed_bodies_are_not_poison_after_ordinary_crashes():
    """The probe sends the same few bodies all day (lorafarm/probe.py): a crash loop of one replica
    and then an unrelated crash of another, each with a probe body in flight and probes completing
    in between, never refuse it."""
    from lorafarm.probe import ProbeConfig, probe_body
    from router.poison import PoisonGuard, fingerprint

    cfg = ProbeConfig(router_url="http://router", api_key="k", targets={"probe/c0:prod": "<<c0000>>"})
    fp = fingerprint("probe", "chat", probe_body(cfg, "probe/c0:prod", "hello"))
    now = [0.0]
    g = PoisonGuard(threshold=2, clock=lambda: now[0])
    for death in range(1, 4):  # r0 crash-loops: its deaths are one replica
        now[0] += 30.0
        g.record_death(fp, "r0", ("r0", death))
        assert g.refused_for(fp) == 0.0
    g.completed(fp)  # the next probe answered, on r1
    now[0] += 30.0
    g.record_death(fp, "r1", ("r1", 1))
    assert g.refused_for(fp) == 0.0 and g.replicas(fp) == {"r1": 1}


async def test_upstream_connections_expire_before_a_replica_closes_them():
    """The router never reuses an idle upstream connection a replica may be closing: its pool drops
    one before the replica's keep-alive timeout would (a request on a closing connection fails before
    its first byte, a 503 where the replica is the only one)."""
    from lorafarm.serving import ClientLimits

    async with make_http_client(8, httpx.Timeout(5.0)) as client:
        pool = client._transport._pool  # noqa: SLF001 - the setting under test
        assert pool._keepalive_expiry == UPSTREAM_KEEPALIVE_S < ClientLimits().keep_alive_timeout  # noqa: SLF001


def test_the_test_only_killer_body_kills_only_where_its_env_is_set():
    """lorafarm/openai_schemas.py's test fault: a process that parses a body holding the marker of
    LORAFARM_TEST_KILLER_BODY SIGKILLs itself (as a body that crashes the engine would); without the
    env (production) the marker is plain text."""
    import os
    import signal
    import subprocess
    import sys

    from lorafarm.openai_schemas import TEST_KILLER_ENV

    marker = "lorafarm-test-killer-body-unit"
    code = ("import json; from lorafarm import openai_schemas as o; "
            f"o.parse_request(o.ChatCompletionRequest, json.dumps({{'model': 'm', 'messages': "
            f"[{{'role': 'user', 'content': 'x {marker} y'}}]}}).encode()); print('alive')")
    env = {k: v for k, v in os.environ.items() if k != TEST_KILLER_ENV}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert off.returncode == 0 and "alive" in off.stdout, off.stderr
    on = subprocess.run([sys.executable, "-c", code], env={**env, TEST_KILLER_ENV: marker}, capture_output=True,
                        text=True, timeout=60)
    assert on.returncode == -signal.SIGKILL and "alive" not in on.stdout
