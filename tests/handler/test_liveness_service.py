"""Liveness and admission of a real replica (issue 26), through a real uvicorn server on 127.0.0.1:
keep-alive comments on a stream while its request waits, shedding before accepting when the
engine's queued work is too large, and a client that leaves during admission counted as cancelled.
One device slot makes the waits deterministic: a request on a second adapter waits for the slot
until the first adapter's request ends (the tests wait on those states, not on time)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.handler.conftest_service import (  # noqa: F401 - fixtures
    ReplicaServer,
    chat_body,
    make_config,
    service_archives,
    sse_events,
    wait_until,
)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def busy_engine(dev_model, tmp_path_factory):
    """A standalone replica of the dev model (no adapters needed) with ONE batch row: a second
    request waits in the engine's queue until the first one ends."""
    from handler.serving.config import REPLICA_ENGINE, Limits, ReplicaConfig

    cfg = ReplicaConfig(base_dir=dev_model, replica_id="rb", model_name="dev-tiny",
                        disk_dir=tmp_path_factory.mktemp("replica-busy"),
                        engine=REPLICA_ENGINE.replace(kv_cache_bytes=8 * 1024 * 1024, max_batch=1),
                        limits=Limits(max_waiting=8, default_max_tokens=32, stream_keepalive_s=0.1,
                                      max_queued_tokens=1000))
    with ReplicaServer(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def lone_slot(dev_model, service_archives, tmp_path_factory):
    """One device slot: a request on a second adapter waits for the slot (before the engine)."""
    from handler.serving.config import Limits

    cfg = make_config(dev_model, service_archives, tmp_path_factory.mktemp("replica-liveness"), replica_id="rl",
                      rank_pools={16: 1}, limits=Limits(rank_limit=16, max_waiting=4, default_max_tokens=32,
                                                        stream_keepalive_s=0.1, max_queued_tokens=0))
    with ReplicaServer(cfg) as srv:
        yield srv


def _has_content(line: str) -> bool:
    return line.startswith("data: {") and '"content":"' in line.replace(" ", "") and \
        '"content":""' not in line.replace(" ", "")


def _cancelled(srv) -> float:
    return sum(srv.service.metrics.requests.labels(tier=t, finish_reason="cancelled")._value.get()
               for t in ("gpu", "remote", "ram", "disk"))


class _Holder:
    """A long stream on adapter `aid` that holds the only slot (and with `engine`, the only batch row:
    the engine is paused) from `start()` (its first token is out) until `stop()` (its client leaves:
    the request is cancelled, the slot freed)."""

    def __init__(self, http: httpx.AsyncClient, url: str, aid: str, max_tokens: int, engine=None):
        self.body = chat_body(aid, max_tokens=max_tokens, stream=True, ignore_eos=True)
        self.http, self.url = http, url
        self.engine = engine
        self._paused = False
        self._cm = None
        self.lines = None

    async def start(self) -> None:
        self._cm = self.http.stream("POST", self.url, json=self.body)
        resp = await self._cm.__aenter__()
        assert resp.status_code == 200
        self.lines = resp.aiter_lines()  # kept: a collected iterator would close the response
        while not _has_content(await anext(self.lines)):  # running: its first token is out
            pass
        if self.engine is not None:
            # the engine steps no further until stop(): the stream cannot end on its own, however fast
            # the machine generates (600 tokens took 0.2 s here, two keep-alive intervals)
            await asyncio.to_thread(self.engine._step_lock.acquire)
            self._paused = True

    async def stop(self) -> None:
        if self._paused:
            self._paused = False
            self.engine._step_lock.release()
        if self._cm is not None:
            cm, self._cm = self._cm, None
            await cm.__aexit__(None, None, None)

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()


async def test_stream_waiting_in_the_engine_queue_gets_keepalives_then_its_answer(busy_engine):
    """B waits in the engine's queue behind A (one batch row): B's stream is committed (status, role
    chunk) and gets `: keep-alive` comments while it waits; once A leaves, B's answer follows."""
    url = f"{busy_engine.url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        async with _Holder(http, url, "dev-tiny", max_tokens=600, engine=busy_engine.engine) as holder:
            body_b = chat_body("dev-tiny", max_tokens=8, stream=True, stream_options={"include_usage": True})
            async with http.stream("POST", url, json=body_b) as resp_b:
                assert resp_b.status_code == 200
                lines_b = resp_b.aiter_lines()
                seen = []
                while seen.count(": keep-alive") < 2:
                    seen.append(await anext(lines_b))
                assert busy_engine.engine.stats().waiting == 1  # B still waits: only keep-alives so far
                assert not any(_has_content(x) for x in seen)
                await holder.stop()  # A leaves; B runs
                rest = seen + [x async for x in lines_b]
    events = sse_events("\n".join(rest))
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] >= 1


async def test_stream_waiting_for_a_slot_gets_keepalives_then_its_answer(lone_slot, service_archives):
    """Admission itself pending (B's adapter waits for the only slot, before the engine): the stream
    is committed after one keep-alive interval and keeps getting keep-alives; then B's marker."""
    a, b = service_archives.good["c0000"], service_archives.good["c0001"]
    url = f"{lone_slot.url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        async with _Holder(http, url, a, max_tokens=600, engine=lone_slot.engine) as holder:
            async with http.stream("POST", url, json=chat_body(b, stream=True)) as resp_b:
                assert resp_b.status_code == 200 and lone_slot.cache.refcount(a) == 1
                lines_b = resp_b.aiter_lines()
                seen = []
                while seen.count(": keep-alive") < 2:
                    seen.append(await anext(lines_b))
                assert not any("<<" in x for x in seen)
                await holder.stop()  # A leaves; B gets the slot
                rest = seen + [x async for x in lines_b]
    events = sse_events("\n".join(rest))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict) and e["choices"])
    assert text == service_archives.markers[b] and events[-1] == "[DONE]"


async def test_overloaded_replica_sheds_before_accepting(busy_engine):
    """A lone request is always admitted, even above the bound; with 1,500 tokens of work queued the
    next request gets 503 overloaded with Retry-After before anything is accepted; once the work is
    done it is served."""
    url = f"{busy_engine.url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        async with _Holder(http, url, "dev-tiny", max_tokens=1500, engine=busy_engine.engine):
            r = await http.post(url, json=chat_body("dev-tiny", max_tokens=16))
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "1"
            assert busy_engine.engine.stats().waiting == 0  # refused, not queued
        assert await wait_until(lambda: busy_engine.engine.stats().tokens_in_flight == 0, 30)
        r = await http.post(url, json=chat_body("dev-tiny", max_tokens=16))
        assert r.status_code == 200


async def test_client_leaving_while_queued_in_the_engine_is_counted_cancelled(busy_engine):
    h = busy_engine.service.handler
    url = f"{busy_engine.url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        async with _Holder(http, url, "dev-tiny", max_tokens=600, engine=busy_engine.engine):
            before = _cancelled(busy_engine)
            task = asyncio.create_task(http.post(url, json=chat_body("dev-tiny", max_tokens=8)))
            assert await wait_until(lambda: busy_engine.engine.stats().waiting == 1, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await wait_until(lambda: _cancelled(busy_engine) >= before + 1, 20)
            assert await wait_until(lambda: busy_engine.engine.stats().waiting == 0, 20)
    assert h._waiting_for_adapter == 0


async def test_client_leaving_during_admission_is_counted_cancelled(lone_slot, service_archives):
    """Issue 26: a 499 was logged but the cancelled counter did not move (the client left while its
    request waited for its adapter, before the engine had it). Now it is counted."""
    a, b = service_archives.good["c0000"], service_archives.good["c0003"]
    url = f"{lone_slot.url}/v1/chat/completions"
    h = lone_slot.service.handler
    async with httpx.AsyncClient(timeout=60) as http:
        async with _Holder(http, url, a, max_tokens=600, engine=lone_slot.engine):
            before = _cancelled(lone_slot)
            waiting = h._waiting_for_adapter
            task = asyncio.create_task(http.post(url, json=chat_body(b)))
            assert await wait_until(lambda: h._waiting_for_adapter > waiting, 20)  # B waits for the slot
            task.cancel()  # the client leaves
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await wait_until(lambda: _cancelled(lone_slot) >= before + 1, 20)
            assert await wait_until(lambda: h._waiting_for_adapter == waiting, 20)
