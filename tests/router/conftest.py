"""A small farm of test doubles (stand-in registry + stand-in replicas) with the real router in
front, all served by uvicorn on 127.0.0.1 inside the test's event loop."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from router.app import create_app
from router.config import RouterSettings
from tests.router.doubles import ADMIN_TOKEN, FakeRegistry, FakeReplica, Served, start_server
from tests.waiting import wait_until


@dataclass
class RouterFarm:
    registry: FakeRegistry
    registry_served: Served
    replicas: dict[str, FakeReplica] = field(default_factory=dict)
    replica_served: dict[str, Served] = field(default_factory=dict)
    router_served: Served | None = None
    app: object = None

    @property
    def core(self):
        return self.app.state.core

    @property
    def url(self) -> str:
        return self.router_served.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def add_replica(self, rid: str, base: str = "dev-a", **kw) -> FakeReplica:
        rep = FakeReplica(rid, base=base, **kw)
        served = await start_server(rep.app())
        self.replicas[rid] = rep
        self.replica_served[rid] = served
        self.registry.add_replica(rid, served.url, base)
        return rep

    async def kill(self, rid: str) -> None:
        await self.replica_served[rid].stop(kill=True)

    async def sync(self) -> None:
        """Make the router see the registry and the replicas now (instead of waiting a poll)."""
        await self.core.refresh_routing()
        await self.core.view.poll_states()

    def client(self, api_key: str, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=20, **kw)


async def wait_for(cond, timeout: float = 5.0, interval: float = 0.02) -> float:
    """tests.waiting.wait_until for the router tests; returns the seconds it waited."""
    start = time.monotonic()
    await wait_until(cond, timeout, interval)
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def router_farm(replicas=(("r0", "dev-a"), ("r1", "dev-a")), replica_kw=None, **settings_kw):
    registry = FakeRegistry()
    reg_served = await start_server(registry.app())
    farm = RouterFarm(registry, reg_served)
    try:
        for rid, base in replicas:
            await farm.add_replica(rid, base, **(replica_kw or {}))
        defaults = dict(
            registry_url=reg_served.url,
            admin_token=ADMIN_TOKEN,
            poll_interval=0.1,
            routing_poll_interval=0.1,
            state_timeout=0.5,
            health_timeout=0.5,
            stats_window=0.3,
            connect_timeout=1.0,
            first_byte_timeout=5.0,
            read_timeout=5.0,
        )
        defaults.update(settings_kw)
        farm.app = create_app(RouterSettings(**defaults))
        farm.router_served = await start_server(farm.app)
        yield farm
    finally:
        if farm.router_served:
            await farm.router_served.stop()
        for s in farm.replica_served.values():
            await s.stop()
        await reg_served.stop()
