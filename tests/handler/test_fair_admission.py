"""Admission shedding fair by tenant (issue 35): the rule (`handler.serving.shedding.fair_admits`) on
its own, then a real replica (uvicorn on 127.0.0.1, one batch row, the engine paused while the
queues are filled) where an attacker tenant holds the waiting cap or the token bound and a victim
tenant's requests are still admitted. Statuses and counts, never time."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from handler.serving.shedding import SHED_CEILING, fair_admits
from tests.handler.conftest_service import ReplicaServer, chat_body, wait_until

pytestmark = pytest.mark.timeout(900)


# ------------------------------------------------------------------------------ the rule


def test_under_the_cap_everyone_is_admitted_first_come_first_served():
    assert fair_admits(0, {}, "a", 4)
    assert fair_admits(3, {"a": 3}, "a", 4)  # 3 + 1 <= 4
    assert fair_admits(900, {"a": 900}, "a", 1000, add=100)


def test_a_tenant_alone_has_the_whole_cap_and_no_more():
    """One tenant (or no router: every request the anonymous tenant None) sheds as the global rule."""
    assert not fair_admits(4, {"a": 4}, "a", 4)
    assert not fair_admits(4, {None: 4}, None, 4)
    assert not fair_admits(950, {"a": 950}, "a", 1000, add=100)


def test_the_cap_is_shared_among_the_tenants_holding_some():
    held = {"attacker": 4}
    assert not fair_admits(4, held, "attacker", 4)
    assert fair_admits(4, held, "victim", 4)  # holds nothing: admitted
    held["victim"] = 1
    assert fair_admits(5, held, "victim", 4)  # 1 + 1 <= 4 // 2
    held["victim"] = 2
    assert not fair_admits(6, held, "victim", 4)  # 2 + 1 > 2: its share is full
    assert not fair_admits(6, held, "attacker", 4)
    assert fair_admits(6, held, "third", 4)  # holds nothing
    held["third"] = 1
    assert not fair_admits(7, held, "third", 4)  # 1 + 1 > 4 // 3
    # tenants holding 0 do not count as sharing
    assert fair_admits(5, {"attacker": 4, "victim": 1, "gone": 0}, "victim", 4)


def test_tokens_the_request_itself_counts_against_the_share():
    held = {"attacker": 1520}
    assert fair_admits(1520, held, "attacker", 2000, add=30)  # under the bound
    assert not fair_admits(1520, held, "attacker", 2000, add=620)
    assert fair_admits(1520, held, "victim", 2000, add=620)  # holds nothing
    held["victim"] = 620
    assert not fair_admits(2140, held, "victim", 2000, add=620)  # 1240 > 2000 // 2
    assert fair_admits(2140, held, "victim", 2000, add=320)  # 940 <= 1000


def test_never_past_the_ceiling():
    cap = 4
    held = {f"t{i}": 1 for i in range(SHED_CEILING * cap)}
    total = sum(held.values())
    assert total == SHED_CEILING * cap
    assert not fair_admits(total, held, "newcomer", cap)  # holds nothing, but the replica is full
    assert fair_admits(total - 1, held, "newcomer", cap)
    assert not fair_admits(1500, {"a": 1500}, "b", 1000, add=501)  # 2001 > 2 x 1000


def test_the_shares_bound_the_total_and_every_tenant_gets_its_share():
    """Greedy arrivals: each of k tenants asks for more until refused; each ends with its share or
    more (the early ones may hold the global cap between them), never the total past the ceiling."""
    cap = 12
    for k in range(1, 6):
        held = {f"t{i}": 0 for i in range(k)}
        total = 0
        for _ in range(3 * cap):
            for t in held:
                if fair_admits(total, held, t, cap):
                    held[t] += 1
                    total += 1
        sharing = sum(1 for v in held.values() if v)
        assert total <= SHED_CEILING * cap
        assert all(v >= min(cap // sharing, cap) for v in held.values()), (k, held)
        if k == 1:
            assert held == {"t0": cap}


# ------------------------------------------------------------------------------ a real replica

URL = "/v1/chat/completions"


@pytest.fixture(scope="module")
def one_row(dev_model, tmp_path_factory):
    """A standalone replica of the dev model with ONE batch row, a waiting cap of 4 and a bound of
    2,000 queued tokens."""
    from handler.serving.config import REPLICA_ENGINE, Limits, ReplicaConfig

    cfg = ReplicaConfig(base_dir=dev_model, replica_id="rf", model_name="dev-tiny",
                        disk_dir=tmp_path_factory.mktemp("replica-fair-admission"),
                        engine=REPLICA_ENGINE.replace(kv_cache_bytes=8 * 1024 * 1024, max_batch=1),
                        limits=Limits(max_waiting=4, max_queued_tokens=2000, default_max_tokens=32,
                                      stream_keepalive_s=0.1))
    with ReplicaServer(cfg) as srv:
        yield srv


def _has_content(line: str) -> bool:
    s = line.replace(" ", "")
    return line.startswith("data: {") and '"content":"' in s and '"content":""' not in s


def tenant(name: str) -> dict:
    return {"x-lorafarm-tenant": name}


class Pause:
    """The attacker's long stream holds the only batch row, and the engine is then paused, so that
    whatever is admitted after it stays waiting until `release`. Deterministic on a busy box: the
    engine's own thread is stopped first, the test runs the one step that admits the attacker and
    gives its first token, then nothing runs until `release` starts the thread again."""

    def __init__(self, http: httpx.AsyncClient, srv, max_tokens: int):
        self.http, self.srv, self.max_tokens = http, srv, max_tokens
        self._cm = None
        self._paused = False

    async def __aenter__(self):
        engine = self.srv.engine
        await asyncio.to_thread(engine.stop)
        self._paused = True
        body = chat_body("dev-tiny", max_tokens=self.max_tokens, stream=True, ignore_eos=True)
        self._cm = self.http.stream("POST", f"{self.srv.url}{URL}", json=body, headers=tenant("attacker"))
        opened = asyncio.ensure_future(self._cm.__aenter__())
        assert await wait_until(lambda: waiting_of(self.srv, "attacker") == 1, 30)
        await asyncio.to_thread(engine.step)  # admitted, prefilled: its first token and no more
        resp = await opened
        assert resp.status_code == 200
        self._lines = resp.aiter_lines()
        while not _has_content(await anext(self._lines)):  # running: its first token is out
            pass
        return self

    def release(self) -> None:
        if self._paused:
            self._paused = False
            self.srv.engine.start()

    async def __aexit__(self, *exc):
        self.release()
        cm, self._cm = self._cm, None
        await cm.__aexit__(None, None, None)  # the attacker's stream leaves: its request is cancelled


def waiting_of(srv, name: str) -> int:
    return sum(a.waiting for a in srv.engine.tenant_stats().active if a.client == name)


async def idle(srv) -> None:
    assert await wait_until(lambda: not srv.engine.has_work() and not srv.service.handler._inflight, 60)


async def test_an_attacker_holding_the_waiting_cap_does_not_get_the_victim_refused(one_row):
    """Cap 4: the attacker queues 4 requests behind its running stream, its 5th is 429 queue_full;
    the victim is still admitted twice (its share, 4 // 2 tenants), its third is refused; the
    attacker stays refused. Once the engine runs, every admitted request is answered."""
    srv = one_row
    await idle(srv)
    async with httpx.AsyncClient(timeout=120) as http:
        def post(name, **kw):
            body = chat_body("dev-tiny", max_tokens=8, **kw)
            return asyncio.ensure_future(http.post(f"{srv.url}{URL}", json=body, headers=tenant(name)))
        async with Pause(http, srv, max_tokens=600) as pause:
            admitted = []
            for i in range(4):
                admitted.append(post("attacker", user=f"a{i}"))
                assert await wait_until(lambda: waiting_of(srv, "attacker") == i + 1, 30)
            r = await post("attacker", user="a4")
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert r.headers["retry-after"] == "1"
            for i in range(2):  # before issue 35's fair shedding, both were 429 queue_full
                admitted.append(post("victim", user=f"v{i}"))
                assert await wait_until(lambda: waiting_of(srv, "victim") == i + 1, 30)
            r = await post("victim", user="v2")
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            r = await post("attacker", user="a5")
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert srv.engine.stats().waiting == 6  # within twice the cap
            assert not any(t.done() for t in admitted)
            pause.release()
            answers = await asyncio.gather(*admitted)
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    await idle(srv)


async def test_an_attacker_holding_the_token_bound_does_not_get_the_victim_refused(one_row):
    """Bound 2,000 tokens: the attacker's running stream holds ~1,500 of them; its next request of
    ~620 is 503 overloaded; the victim's first (620 tokens: it held none) and a second that fits its share
    (2,000 // 2 tenants) are admitted, a second that does not is 503 overloaded."""
    srv = one_row
    await idle(srv)
    async with httpx.AsyncClient(timeout=120) as http:
        async def post(name, max_tokens, **kw):
            return await http.post(f"{srv.url}{URL}", json=chat_body("dev-tiny", max_tokens=max_tokens, **kw),
                                   headers=tenant(name))

        async with Pause(http, srv, max_tokens=1500) as pause:
            assert 1400 < srv.engine.stats().tokens_in_flight < 2000
            r = await post("attacker", 600)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            assert r.headers["retry-after"] == "1"
            first = asyncio.ensure_future(post("victim", 600, user="v0"))
            assert await wait_until(lambda: waiting_of(srv, "victim") == 1, 30)
            r = await post("victim", 600, user="v1")  # 2 x ~620 > its share of 1,000
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            second = asyncio.ensure_future(post("victim", 300, user="v2"))  # ~620 + ~320 <= 1,000
            assert await wait_until(lambda: waiting_of(srv, "victim") == 2, 30)
            r = await post("attacker", 8)  # over the bound and over its share: even a small one
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            assert srv.engine.stats().tokens_in_flight <= 2 * 2000
            pause.release()
            answers = await asyncio.gather(first, second)
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    await idle(srv)
