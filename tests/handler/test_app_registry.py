"""The replica's production path against a registry stand-in (the real registry is another package):
join + heartbeat with ReplicaState, owned adapters pulled to RAM and pre-warmed, adapter bytes from
the object store (weights_uri must lie inside it) or, without a store, the registry's download."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from litestar import Litestar, Request, get, post
from litestar.response import File, Response

from tests.handler.conftest_service import (  # noqa: F401 - fixtures
    ReplicaServer,
    ServerThread,
    chat_body,
    make_config,
    service_archives,
    wait_until,
)

TOKEN = "registry-admin"


class FakeRegistry:
    def __init__(self, catalog: dict[str, str], store_dir: Path, owned: list[str], outside: str):
        self.catalog = dict(catalog)
        self.catalog[outside] = "file:///etc/passwd"  # a weights_uri outside the store
        self.store_dir = store_dir
        self.owned = owned
        self.joins: list[dict] = []
        self.heartbeats: list[dict] = []
        self.downloads: list[str] = []
        self.unauthorized = 0

    def app(self) -> Litestar:
        reg = self

        def auth(request: Request):
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                reg.unauthorized += 1
                raise_401()

        def raise_401():
            from litestar.exceptions import NotAuthorizedException

            raise NotAuthorizedException("bad token")

        @post("/internal/replicas/join", status_code=200)
        async def join(request: Request) -> dict:
            auth(request)
            body = await request.json()
            reg.joins.append(body)
            return {**body, "status": "up"}

        @post("/internal/replicas/{rid:str}/heartbeat", status_code=200)
        async def heartbeat(request: Request, rid: str) -> dict:
            auth(request)
            reg.heartbeats.append(await request.json())
            return {"replica_id": rid, "status": "up"}

        @get("/internal/placements")
        async def placements(request: Request, replica_id: str) -> dict:
            auth(request)
            return {"replica_id": replica_id, "adapters": reg.owned}

        @get("/internal/adapters/{aid:str}")
        async def adapter(request: Request, aid: str) -> Response:
            auth(request)
            if aid not in reg.catalog:
                return Response({"error": {"message": "no such adapter", "type": "invalid_request_error",
                                           "param": None, "code": "adapter_not_found"}}, status_code=404)
            return Response({"adapter_id": aid, "weights_uri": reg.catalog[aid], "status": "active"})

        @get("/internal/adapters/{aid:str}/archive")
        async def archive(request: Request, aid: str) -> File:
            auth(request)
            reg.downloads.append(aid)
            key = reg.catalog[aid].split("/store/", 1)[1]
            return File(path=reg.store_dir / key, media_type="application/x-tar")

        @get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        return Litestar([join, heartbeat, placements, adapter, archive, health], openapi_config=None)


@pytest.fixture(scope="module")
def registry(service_archives):
    arch = service_archives
    owned = [arch.good["c0000"], arch.good["c0001"], arch.good["c0003"], arch.bad_base]
    reg = FakeRegistry(json.loads(arch.catalog.read_text()), arch.store_dir, owned, "ad-0000000000000000beef")
    with ServerThread(reg.app()) as srv:
        reg.url = srv.url
        yield reg


@pytest.fixture(scope="module")
def replica_with_store(dev_model, service_archives, registry, tmp_path_factory):
    cfg = make_config(dev_model, service_archives, tmp_path_factory.mktemp("replica-reg"), replica_id="r3",
                      registry_url=registry.url, admin_token=TOKEN, prewarm=1, heartbeat_s=0.2)
    cfg.adapter_catalog = None
    with ReplicaServer(cfg) as srv:
        yield srv


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_join_heartbeat_and_pull_owned(replica_with_store, registry, service_archives):
    srv, arch = replica_with_store, service_archives
    assert await wait_until(lambda: srv.service.pull_done.is_set() and len(registry.heartbeats) >= 1, 30)
    join = registry.joins[0]
    assert join["replica_id"] == "r3" and join["url"] == srv.url and join["models"] == ["dev-tiny"]
    assert join["base_model_hash"] == srv.service.handler.base_model_hash
    hb = registry.heartbeats[-1]
    assert {"gpu_adapters", "ram_adapters", "queue_depth", "tokens_in_flight", "evictions_per_min",
            "base_model_hash", "models"} <= set(hb)
    assert registry.unauthorized == 0
    first, second, third = arch.good["c0000"], arch.good["c0001"], arch.good["c0003"]
    # the first owned adapter pre-warmed into a slot, the others pulled to RAM; the bad one refused
    assert srv.cache.gpu_adapters() == [first]
    assert {second, third} <= set(srv.cache.ram_adapters())
    assert srv.cache.tier_of(arch.bad_base) == "remote"
    assert registry.downloads == []  # bytes came from the object store
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
        r = await http.post(f"{srv.url}/v1/chat/completions", json=chat_body(second))
        assert r.status_code == 200 and r.headers["x-adapter-tier"] == "ram"
        assert r.json()["choices"][0]["message"]["content"] == arch.markers[second]
        r = await http.post(f"{srv.url}/v1/chat/completions", json=chat_body(first))
        assert r.headers["x-adapter-tier"] == "gpu"
        # the next heartbeat reports both in device slots
        n = len(registry.heartbeats)
        assert await wait_until(lambda: len(registry.heartbeats) > n, 5)
        assert {first, second} <= set(registry.heartbeats[-1]["gpu_adapters"])
        # a weights_uri outside the configured store is refused, nothing fetched
        r = await http.post(srv.internal("adapters/ad-0000000000000000beef/load"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_store_error"
        assert "outside the configured object store" in r.json()["error"]["message"]
        # unknown to the registry: 404
        r = await http.post(f"{srv.url}/v1/chat/completions", json=chat_body("ad-99999999999999999999"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_registry_download_without_store(dev_model, service_archives, registry, tmp_path):
    cfg = make_config(dev_model, service_archives, tmp_path, replica_id="r4", registry_url=registry.url,
                      admin_token=TOKEN, pull_owned=False)
    cfg.adapter_catalog = None
    cfg.store_url = None
    aid = service_archives.good["c0004"]
    with ReplicaServer(cfg) as srv:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            r = await http.post(f"{srv.url}/v1/chat/completions", json=chat_body(aid))
            assert r.status_code == 200, r.text
            assert r.headers["x-adapter-tier"] == "remote"
            assert r.json()["choices"][0]["message"]["content"] == service_archives.markers[aid]
        assert aid in registry.downloads


async def test_pull_owned_stops_when_the_disk_tier_is_full(dev_model, service_archives, tmp_path):
    """More owned adapters than the disk tier holds (5,000 in the load test): the first pull takes
    what fits and leaves the rest in the store. Before, it pulled every one, each pushing out one
    pulled a moment before (here: 5 evictions of 6 pulls): minutes of churn beside the traffic, and /ready said "warming" all along."""
    arch = service_archives
    owned = [arch.good[n] for n in ("c0000", "c0003", "c0006", "c0007", "c0009", "c0010")]
    reg = FakeRegistry(json.loads(arch.catalog.read_text()), arch.store_dir, owned, "ad-0000000000000000beef")
    with ServerThread(reg.app()) as rs:
        reg.url = rs.url
        cfg = make_config(dev_model, service_archives, tmp_path, replica_id="r5", registry_url=rs.url,
                          admin_token=TOKEN, prewarm=0, heartbeat_s=0.2, disk_bytes=2_000_000)  # room for 2-4 of the 6 (0.24-1.2 MB each)
        cfg.adapter_catalog = None
        with ReplicaServer(cfg) as srv:
            assert await wait_until(lambda: srv.service.pull_done.is_set(), 30)
            cache = srv.cache
            pulled = set(cache.disk_adapters())
            assert 0 < len(pulled) < len(owned)
            # two pulls run at once and an entry grows when its slot image is written: each pull under way when
            # the tier filled may push one out
            assert cache.counters.disk_evictions <= 2
            left = [a for a in owned if cache.tier_of(a) == "remote"]  # never pulled (an evicted one may be in RAM)
            assert left
            async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:  # and is still served from the store
                r = await http.post(f"{srv.url}/v1/chat/completions", json=chat_body(left[0]))
                assert r.status_code == 200 and r.headers["x-adapter-tier"] == "remote"
                assert r.json()["choices"][0]["message"]["content"] == arch.markers[left[0]]
                assert (await http.get(f"{srv.url}/ready")).status_code == 200
