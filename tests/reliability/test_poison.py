"""Issue 35 item 5, poison that is real, through real processes: a farm of three replicas (registry,
router and replicas as child processes on 127.0.0.1) started with the test-only killer body
(`LORAFARM_TEST_KILLER_BODY`, lorafarm/openai_schemas.py: a replica that parses a body holding the
marker SIGKILLs itself).

- a popular body ("Reset my password", one tenant, several connections, streamed and not) in flight
  at three ordinary SIGKILLs of one replica: 0 poison refusals (before: refused for 10 minutes
  after the second kill, 26% of requests);
- in flight at one SIGKILL each of two replicas, completing elsewhere after each: 0 refusals;
- the killer body costs at most two replicas, is answered 400 poison_request naming them, and is
  refused afterwards (also once they are back) while the third replica keeps serving.

Every test restores what it killed in a `finally` and waits until the router routes to it again.
No timed assertions: the tests wait on conditions (a request running on the replica, the router's
death counter, completions after a kill)."""

from __future__ import annotations

import collections
import os
import re
import signal
import threading

import httpx
import openai
import pytest

from lorafarm.openai_schemas import TEST_KILLER_ENV
from tests.e2e.conftest import running, seeded_farm
from tests.reliability.conftest import (
    REGISTRY_ARGS, ROUTER_ARGS, all_routed, client, farm_diagnostics, repair_farm, replica_state, restart_replica,
    wait_for, wait_routed,
)

KILLER = "lorafarm-test-killer-body-8c1f2d"  # in a body: the replica that parses it dies (test farms only)
BASE = "lorafarm-dev-tiny"
POPULAR = [{"role": "user", "content": "Reset my password"}]
SAFETY = 60.0


@pytest.fixture(scope="module")
def pfarm(tmp_path_factory, dev_model, canaries):
    before = os.environ.get(TEST_KILLER_ENV)
    os.environ[TEST_KILLER_ENV] = KILLER  # every replica of this farm, restarts included
    try:
        farm = seeded_farm(tmp_path_factory.mktemp("pfarm"), dev_model, canaries, 3, 2)
        farm.router_args = list(ROUTER_ARGS)
        farm.registry_args = list(REGISTRY_ARGS)
        with running(farm) as info:
            yield info
    finally:
        if before is None:
            os.environ.pop(TEST_KILLER_ENV, None)
        else:
            os.environ[TEST_KILLER_ENV] = before


@pytest.fixture(scope="module")
def pkey(pfarm):
    return pfarm["tenants"][0]["api_key"]


def _metric(farm, name: str, match: str = "") -> float:
    text = httpx.get(farm["router_url"] + "/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and (not match or match in line))


def _deaths(farm) -> float:
    return _metric(farm, "lorafarm_router_replica_deaths_total")


def _poison(farm) -> float:
    return _metric(farm, "lorafarm_router_poison_requests_total")


class PopularLoad:
    """One tenant sending the same body over `conns` connections, streamed and not, until stopped;
    counts outcomes: ok, error_event (a stream cut by a dying replica), http_<status>_<code>."""

    def __init__(self, farm, key: str, conns: int = 4, max_tokens: int = 1200):
        self.farm, self.key, self.conns, self.max_tokens = farm, key, conns, max_tokens
        self.outcomes: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i % 2 == 0,), daemon=True) for i in range(conns)]

    def __enter__(self) -> PopularLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=SAFETY * 2)

    def ok(self) -> int:
        with self.lock:
            return self.outcomes["ok"]

    def refusals(self) -> int:
        with self.lock:
            return sum(n for k, n in self.outcomes.items() if "poison" in k)

    def _count(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] += 1

    def _run(self, stream: bool) -> None:
        body = {"model": BASE, "messages": POPULAR, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.farm["router_url"], headers=headers, timeout=SAFETY) as http:
            while not self.stop.is_set():
                try:
                    self._count(self._one(http, body))
                except httpx.HTTPError as e:
                    self._count(f"transport_{type(e).__name__}")

    @staticmethod
    def _one(http: httpx.Client, body: dict) -> str:
        if not body["stream"]:
            r = http.post("/v1/chat/completions", json=body)
            return "ok" if r.status_code == 200 else _http(r)
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return _http(r)
            error = False
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]" and '"error"' in line:
                    error = True
            return "error_event" if error else "ok"


def _http(r: httpx.Response) -> str:
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return f"http_{r.status_code}_{code}"


def _kill_with_the_body_in_flight(farm, load: PopularLoad, i: int) -> None:
    """SIGKILL replica r<i> while it runs the popular body; return once the router has counted the
    death (a request of the body was in flight on it) and the body completed again elsewhere.

    On a loaded box a killed replica can stop answering its health checks before its sockets close
    (the kernel unmaps its memory first): the router may then take it out of routing and fail a
    waiting request over as a timeout, not a death. Such a kill shows nothing about poison: the
    replica is restarted and killed again (at most three times)."""
    proc_name = f"replica-r{i}"

    def running() -> bool:
        try:
            return replica_state(farm, i)["running"] > 0
        except httpx.HTTPError:  # a busy 2-core box: ask again
            return False

    for attempt in range(3):
        wait_for(running, 60, interval=0.05, what=f"the popular body running on r{i}")
        deaths, ok = _deaths(farm), load.ok()
        proc = farm["_farm"].procs[proc_name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        wait_for(lambda: not all_routed(farm), 30, what=f"r{i} out of routing")
        counted = _wait_quietly(lambda: _deaths(farm) > deaths, 15, f"r{i}'s death counted by the router")
        if counted:
            wait_for(lambda: load.ok() > ok, 60, what="the popular body completing on another replica")
            return
        print(f"kill {attempt + 1} of r{i}: no request counted as in flight at its death; again")
        restart_replica(farm, i)
    pytest.fail(f"three kills of r{i} with the body running, none counted by the router as a death")


def _wait_quietly(predicate, timeout: float, what: str) -> bool:
    """tests.waiting.wait_for, but False (not a failure: the caller tries again) when the condition
    does not come; the wait's message is printed with the test's output."""
    try:
        wait_for(predicate, timeout, what=what, interval=0.2)
    except pytest.fail.Exception as e:
        print(e)
        return False
    return True


def test_three_ordinary_sigkills_of_one_replica_refuse_no_popular_body(pfarm, pkey):
    """A crash loop: r0 SIGKILLed three times (restarted in between) with the popular body in flight
    each time. One replica dying again and again is no evidence against the body: 0 refusals."""
    wait_routed(pfarm, 90)
    poison_before = _poison(pfarm)
    deaths_before = _deaths(pfarm)
    try:
        with PopularLoad(pfarm, pkey) as load:
            for _ in range(3):
                _kill_with_the_body_in_flight(pfarm, load, 0)
                restart_replica(pfarm, 0)
        print("crash loop outcomes:", dict(load.outcomes))
    except BaseException:
        print("crash loop outcomes:", dict(load.outcomes) if "load" in locals() else None)
        print(farm_diagnostics(pfarm, "replica-r0"))
        raise
    finally:
        repair_farm(pfarm)
    assert _deaths(pfarm) - deaths_before >= 3  # the body was in flight at each of the three deaths
    assert load.refusals() == 0, dict(load.outcomes)
    assert _poison(pfarm) == poison_before
    assert load.ok() > 0


def test_one_crash_each_of_two_replicas_with_the_body_completing_elsewhere_refuses_nothing(pfarm, pkey):
    """r0 dies with the popular body in flight, the body completes on the others; r0 is back; r1
    dies with it in flight, it completes elsewhere again: two distinct replicas died with it, but it
    completed in between, so it is no poison (before: refused for 10 minutes)."""
    wait_routed(pfarm, 90)
    poison_before = _poison(pfarm)
    try:
        with PopularLoad(pfarm, pkey) as load:
            _kill_with_the_body_in_flight(pfarm, load, 0)
            restart_replica(pfarm, 0)
            _kill_with_the_body_in_flight(pfarm, load, 1)
            restart_replica(pfarm, 1)
            ok = load.ok()
            wait_for(lambda: load.ok() > ok, 60, what="completions after both crashes")
        print("two crashes outcomes:", dict(load.outcomes))
    finally:
        repair_farm(pfarm)
    assert load.refusals() == 0, dict(load.outcomes)
    assert _poison(pfarm) == poison_before


def test_the_killer_body_costs_at_most_two_replicas_and_is_then_refused(pfarm, pkey):
    """The test-only killer body kills every replica it reaches: the first dies, the request goes to
    one more (which dies too), then it is answered 400 poison_request naming both; sent again, it is
    refused before any replica (the third keeps serving), and still once both are back."""
    wait_routed(pfarm, 90)
    procs = pfarm["_farm"].procs
    ids = [r["replica_id"] for r in pfarm["replicas"]]
    c = client(pfarm, pkey, timeout=SAFETY)
    killer = [{"role": "user", "content": f"please {KILLER} now"}]
    deaths = _deaths(pfarm)
    try:
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=BASE, messages=killer, max_tokens=4)
        err = exc.value.body
        assert err["code"] == "poison_request" and exc.value.status_code == 400
        seen = re.search(r"in flight when replicas (r\d+) and (r\d+) died, and has not completed on any replica "
                         r"since", err["message"])
        assert seen, err["message"]  # what was seen: two replicas by name, no completion since
        dead = sorted(ids.index(m) for m in seen.groups())
        for i in dead:  # the two named are the ones that died (their exit may lag their closed sockets)
            procs[f"replica-r{i}"].wait(timeout=30)
        assert _deaths(pfarm) - deaths == 2  # the router saw two deaths with it in flight, no third
        survivor = next(i for i in range(3) if i not in dead)
        assert procs[f"replica-r{survivor}"].poll() is None
        deaths = _deaths(pfarm)
        for stream in (False, True):  # the same body, streamed or not: refused, no replica reached
            with pytest.raises(openai.BadRequestError) as again:
                c.chat.completions.create(model=BASE, messages=killer, max_tokens=4, stream=stream)
            assert again.value.body["code"] == "poison_request"
        assert procs[f"replica-r{survivor}"].poll() is None and _deaths(pfarm) == deaths
        raw = c.chat.completions.with_raw_response.create(model=BASE, messages=POPULAR, max_tokens=4)
        assert raw.headers["x-replica-id"] == ids[survivor]  # the farm serves on
    finally:
        repair_farm(pfarm)
    with pytest.raises(openai.BadRequestError) as later:  # back in routing: still refused (cool-off)
        c.chat.completions.create(model=BASE, messages=killer, max_tokens=4)
    assert later.value.body["code"] == "poison_request"
    assert all(procs[f"replica-r{i}"].poll() is None for i in range(3))

