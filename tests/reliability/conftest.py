"""One real farm for the reliability suite: registry, router and two replicas as child processes on
127.0.0.1 (free ports), with the router's proxy and health timeouts shortened so faults show up in
seconds, and helpers to freeze, kill and restart its processes.

Tests that break something put it back (SIGCONT, restart) before they end, so the suite shares one
farm; the order within a file matters only through that.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from openai import OpenAI

from lorafarm.registry_client import RegistryClient
from tests.e2e.conftest import running, seeded_farm

RELIABILITY_ADAPTERS = 6
# short enough that a frozen replica is noticed in seconds, long enough for a loaded 2-core CI box. The
# request read deadline also judges this suite's own clients: a pytest process that has run the whole
# suite can pause seconds (a full garbage collection on a loaded box) between a request's head and
# its body, and a 2 s deadline then closed healthy soak clients (lost_connection on CI).
ROUTER_ARGS = ["--first-byte-timeout", "4", "--read-timeout", "4", "--poll-interval", "0.5", "--request-timeout", "8"]
REGISTRY_ARGS = ["--replica-timeout", "3"]


@pytest.fixture(scope="session")
def rfarm(tmp_path_factory, dev_model, canaries):
    farm = seeded_farm(tmp_path_factory.mktemp("rfarm"), dev_model, canaries, 2, RELIABILITY_ADAPTERS)
    farm.router_args = list(ROUTER_ARGS)
    farm.registry_args = list(REGISTRY_ARGS)
    with running(farm) as info:
        yield info


@pytest.fixture(scope="session")
def rtenant(rfarm):
    return rfarm["tenants"][0]


@pytest.fixture(scope="session")
def markers(rfarm):
    """alias -> the marker its canary answers with (greedy)."""
    return dict(rfarm["markers"])


def client(farm, key, **kw) -> OpenAI:
    return OpenAI(base_url=farm["router_url"] + "/v1", api_key=key, max_retries=0, **kw)


def admin(farm) -> dict[str, str]:
    return {"Authorization": f"Bearer {farm['admin_token']}"}


def registry(farm) -> RegistryClient:
    return RegistryClient(farm["registry_url"], farm["admin_token"])


def run(coro):
    return asyncio.run(coro)


async def _with_registry(farm, fn):
    async with registry(farm) as reg:
        return await fn(reg)


def reg_call(farm, fn):
    """fn(reg) -> awaitable, run against the farm's registry."""
    return asyncio.run(_with_registry(farm, fn))


def replica_pid(farm, i: int) -> int:
    return farm["_farm"].procs[f"replica-r{i}"].pid


def signal_replica(farm, i: int, sig: int) -> None:
    os.kill(replica_pid(farm, i), sig)


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    """Poll until predicate() is truthy (returns it); fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout:.0f} s")
        time.sleep(interval)


def router_health(farm) -> dict:
    return httpx.get(farm["router_url"] + "/health", timeout=5.0).json()


def replica_state(farm, i: int) -> dict:
    r = farm["replicas"][i]
    resp = httpx.get(f"{r['url']}/internal/replicas/{r['replica_id']}/state", headers=admin(farm), timeout=5.0)
    resp.raise_for_status()
    return resp.json()


def replica_cache(farm, i: int) -> dict:
    r = farm["replicas"][i]
    resp = httpx.get(f"{r['url']}/internal/replicas/{r['replica_id']}/cache", headers=admin(farm), timeout=5.0)
    resp.raise_for_status()
    return resp.json()


def restart_replica(farm, i: int) -> None:
    """After a SIGKILL: start r<i> again on its port and wait until the router routes to it."""
    f = farm["_farm"]
    proc = f.procs[f"replica-r{i}"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    f.start_replica(i)
    farm["replicas"][i]["pid"] = f.procs[f"replica-r{i}"].pid
    # a restart reloads the model and rejoins; on a loaded 2-core box that alone can pass 30 s
    try:
        wait_for(lambda: router_health(farm)["replicas_healthy"] == len(farm["replicas"]), 90,
                 what="replica back in routing")
    except BaseException:
        print(farm_diagnostics(farm, f"replica-r{i}"))
        raise


def farm_diagnostics(farm, *procs: str) -> str:
    """What the router and registry say, and the ends of the named processes' logs (for a failure)."""
    out = []
    for what, get in (("router /health", lambda: router_health(farm)),
                      ("registry replicas", lambda: httpx.get(farm["registry_url"] + "/internal/replicas",
                                                              headers=admin(farm), timeout=5).json())):
        try:
            out.append(f"{what}: {get()}")
        except Exception as e:  # diagnostics must not hide the failure
            out.append(f"{what}: unavailable ({e})")
    logs = farm["_farm"].logs_dir
    for name in ("router", "registry", *procs):
        path = logs / f"{name}.log"
        if path.exists():
            out.append(f"--- {path.name} (last 60 lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-60:]))
    return "\n".join(out)
