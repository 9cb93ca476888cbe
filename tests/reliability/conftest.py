"""One real farm for the reliability suite: registry, router and two replicas as child processes on
127.0.0.1 (free ports), with the router's proxy and health timeouts shortened so faults show up in
seconds, and helpers to freeze, kill and restart its processes.

Tests that break something do it inside `restored(farm)`, which puts the farm back (SIGCONT,
restart, registry and router up with the suite's flags, holds released) pass or fail, and waits until
the router routes to every replica again; before each test on the shared farm `farm_as_found`
checks the same and repairs what is still broken, so one failure stays one failure.

Kill tests hold the stream: the farm's replicas run with the test-only hold point
(handler/serving/holds.py), so a request sent with `hold_id(n)` as its x-request-id stops its
replica's engine after n tokens until the test has done its worst.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from handler.serving.holds import HOLD_ENV
from lorafarm.registry_client import RegistryClient
from tests.e2e.conftest import running, seeded_farm
from tests.waiting import wait_for

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
    holds = farm.state_dir / "holds"
    holds.mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(HOLD_ENV, str(holds))  # every replica of this farm, restarts included
        with running(farm) as info:
            info["_holds"] = holds
            yield info


@pytest.fixture(autouse=True)
def farm_as_found(request):
    """Before each test on the shared farm: repair what an earlier test left broken, so that test's
    failure is not every later test's (the repair is printed with the test's output)."""
    if "rfarm" in request.fixturenames:
        fixed = repair_farm(request.getfixturevalue("rfarm"))
        if fixed:
            print(f"farm repaired before {request.node.name}: {', '.join(fixed)}")
    yield


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
    proc = farm["_farm"].procs[f"replica-r{i}"]
    proc.send_signal(sig)
    if sig == signal.SIGKILL:  # on a busy box a killed process lingers (not yet scheduled to die): wait it out,
        proc.wait(timeout=120)  # so that what follows (and repair_farm) sees it dead


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
    wait_routed(farm, 90, what=f"r{i} back in routing after its restart")


def all_routed(farm) -> bool:
    return router_health(farm)["replicas_healthy"] == len(farm["replicas"])


def wait_routed(farm, timeout: float = 60, what: str = "every replica in routing") -> None:
    wait_for(lambda: all_routed(farm), timeout, what=what, logs=farm_logs(farm))


def farm_logs(farm, *procs: str):
    """For a wait's failure message: what the router and registry say, and the ends of the logs."""
    return lambda: farm_diagnostics(farm, *(procs or [f"replica-r{i}" for i in range(len(farm["replicas"]))]))


def hold_id(after_tokens: int) -> str:
    """An x-request-id that makes the replica hold its engine after `after_tokens` tokens."""
    return f"hold{after_tokens}-{uuid.uuid4().hex[:16]}"


def held(farm, request_id: str) -> int:
    """The pid of the replica holding `request_id` (0 while none does)."""
    path = farm["_holds"] / f"{request_id}.held"
    return int(path.read_text().split()[0]) if path.exists() and path.read_text().strip() else 0


def replica_of_pid(farm, pid: int) -> int:
    return next(i for i in range(len(farm["replicas"])) if replica_pid(farm, i) == pid)


def release_holds(farm) -> None:
    if farm.get("_holds") is None:  # a farm started without the hold point
        return
    for h in farm["_holds"].glob("*.held"):
        h.with_suffix(".release").touch()


def _stopped(pid: int) -> bool:
    """SIGSTOPped (state T in /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def repair_farm(farm) -> list[str]:
    """Put the shared farm back as the suite expects it (every process up and running, the router and
    registry with the suite's flags, no request held) and wait until the router routes to every
    replica; returns what had to be repaired (nothing: one health check)."""
    f = farm["_farm"]
    fixed = []
    expected = {"router", "registry", *(f"replica-r{i}" for i in range(len(farm["replicas"])))}
    for name in [n for n in f.procs if n not in expected]:  # an extra replica a test did not stop
        proc = f.procs.pop(name)
        proc.kill()
        proc.wait(timeout=30)
        fixed.append(f"{name} stopped")
    release_holds(farm)
    for name, proc in f.procs.items():
        if proc.poll() is None and _stopped(proc.pid):
            proc.send_signal(signal.SIGCONT)
            fixed.append(f"{name} continued")

    def dead(name: str) -> bool:
        return name not in f.procs or f.procs[name].poll() is not None

    if dead("registry"):
        f.start_registry()
        fixed.append("registry restarted")
    if dead("router") or f.router_args != ROUTER_ARGS:
        if dead("router"):
            f.procs.pop("router", None)
            f.router_args = list(ROUTER_ARGS)
            f.start_router()
            f.wait_healthy("router", f.router_url)
        else:
            f.restart_router(list(ROUTER_ARGS))
        fixed.append("router restarted")
    down = [i for i in range(len(farm["replicas"])) if dead(f"replica-r{i}")]
    for i in down:
        f.start_replica(i, wait=False)
        farm["replicas"][i]["pid"] = f.procs[f"replica-r{i}"].pid
        fixed.append(f"r{i} restarted")
    for i in down:
        f.wait_healthy(f"replica-r{i}", f.replica_url(i))
    wait_routed(farm, 120, what="every replica in routing" + (f" after repairing: {', '.join(fixed)}" if fixed else ""))
    return fixed


@contextmanager
def restored(farm):
    """Break the farm inside this block: afterwards, pass or fail, it is repaired (`repair_farm`)."""
    try:
        yield
    finally:
        repair_farm(farm)


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
