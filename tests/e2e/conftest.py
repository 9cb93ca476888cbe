"""A real farm for end-to-end tests: registry, router and two replicas as child processes on
127.0.0.1 (free ports), started through `lorafarm.farm.Farm`, the code behind `lorafarm up`.

The state dir is seeded with the cached dev model and canaries so nothing is retrained; the
canary cache keys match because the dev model is byte-identical.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lorafarm.farm import Farm, FarmPorts, wait_router_ready

E2E_ADAPTERS = 16


@pytest.fixture(scope="session")
def farm(tmp_path_factory, dev_model, canaries):
    state = tmp_path_factory.mktemp("farm")
    farm = Farm(state, replicas=2, ports=FarmPorts.free(2), progress=False, demo_adapters=E2E_ADAPTERS)
    shutil.copytree(dev_model, farm.model_dir)
    farm.adapters_dir.mkdir(parents=True)
    for i in range(E2E_ADAPTERS):
        shutil.copytree(canaries / f"c{i:04d}", farm.adapters_dir / f"c{i:04d}")
    try:
        farm.prepare()
        farm.start()
        info = farm.seed()
        wait_router_ready(info)
        info["_farm"] = farm
        yield info
    finally:
        farm.stop()
        for log in sorted(farm.logs_dir.glob("*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text:
                print(f"--- {log.name} (tail) ---\n{text[-3000:]}")


@pytest.fixture(scope="session")
def tenant(farm):
    return farm["tenants"][0]


@pytest.fixture(scope="session")
def adapter_markers(farm, canary_index):
    """adapter id -> the marker its canary answers with."""
    tenant = farm["tenants"][0]
    return {aid: farm["markers"][alias] for alias, aid in tenant["aliases"].items()}


def farm_json(farm) -> dict:
    return json.loads(farm["_farm"].farm_json.read_text())
