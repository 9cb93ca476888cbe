"""A real farm for end-to-end tests: registry, router and two replicas as child processes on
127.0.0.1 (free ports), started through `lorafarm.farm.Farm`, the code behind `lorafarm up`.

The state dir is seeded with the cached dev model and canaries so nothing is retrained; the
canary cache keys match because the dev model is byte-identical.
"""

from __future__ import annotations

import json
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from lorafarm.farm import Farm, FarmPorts
from tests.waiting import wait_for

E2E_ADAPTERS = 16


def seeded_farm(state, dev_model, canaries, replicas: int, adapters: int) -> Farm:
    """A Farm on free ports whose state dir already holds the cached dev model and canaries."""
    from tests.conftest import CACHE

    farm = Farm(state, replicas=replicas, ports=FarmPorts.free(replicas), progress=False, demo_adapters=adapters,
                compile_cache=CACHE)  # compiled kernels kept across test sessions, not per temporary farm
    shutil.copytree(dev_model, farm.model_dir)
    for i in range(adapters):
        shutil.copytree(canaries / f"c{i:04d}", farm.adapters_dir / f"c{i:04d}")
    return farm


@contextmanager
def running(farm: Farm):
    """Start the farm and yield farm.json's content (plus "_farm"); stop it and show any traceback."""
    try:
        info = farm.up()
        info["_farm"] = farm
        yield info
    finally:
        farm.stop()
        for log in sorted(farm.logs_dir.glob("*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text:
                print(f"--- {log.name} (tail) ---\n{text[-3000:]}")


def read_until(proc, text: str, timeout: float, *, logs: Path | None = None) -> str:
    """Read `proc`'s stdout (a text pipe) on a thread, so the pipe never fills, until `text` has been
    printed or the output ended (the process exited); returns the output so far. A timeout fails the
    test with the output's tail and those of the *.log files in `logs` (tests.waiting)."""
    lines: list[str] = []
    ended = threading.Event()

    def read():
        try:
            for line in proc.stdout:
                lines.append(line)
        finally:
            ended.set()

    threading.Thread(target=read, name="stdout-reader", daemon=True).start()
    tails = [lambda: "--- output (last 3000 characters)\n" + "".join(lines)[-3000:]]
    wait_for(lambda: text in "".join(lines) or ended.is_set(), timeout, what=f"{text!r} printed",
             interval=0.05, logs=tails + ([] if logs is None else [logs]))
    return "".join(lines)


@pytest.fixture(scope="session")
def farm(tmp_path_factory, dev_model):
    """Seeded with the first E2E_ADAPTERS shared canaries (no more are made for it)."""
    from tests.conftest import CANARY_DIR, make_canaries

    make_canaries(dev_model, E2E_ADAPTERS)
    with running(seeded_farm(tmp_path_factory.mktemp("farm"), dev_model, CANARY_DIR, 2, E2E_ADAPTERS)) as info:
        yield info


@pytest.fixture(scope="session")
def tenant(farm):
    return farm["tenants"][0]


@pytest.fixture(scope="session")
def adapter_markers(farm):
    """adapter id -> the marker its canary answers with."""
    tenant = farm["tenants"][0]
    return {aid: farm["markers"][alias] for alias, aid in tenant["aliases"].items()}


def farm_json(farm) -> dict:
    return json.loads(farm["_farm"].farm_json.read_text())


@pytest.fixture(scope="module")
def client(farm, tenant):
    """The official openai client on the session farm's router, as the demo tenant."""
    from openai import OpenAI

    return OpenAI(base_url=farm["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alias(tenant) -> str:
    """The demo tenant's first alias."""
    return sorted(tenant["aliases"])[0]
