"""Shared fixtures: the generated dev model and the PEFT-trained canary adapters.

Both are cached under .cache/lorafarm (or $LORAFARM_CACHE_DIR) so repeated runs don't retrain;
the canary cache is keyed by content (see lorafarm.dev.adapters).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LORAFARM_CACHE_DIR", REPO / ".cache" / "lorafarm"))
CANARY_COUNT = 32  # batch invariance needs 32 distinct adapters
CANARY_DIR = CACHE / "canaries-tiny-s0"

_PYTEST_CONFIG = None


def pytest_configure(config):
    global _PYTEST_CONFIG
    _PYTEST_CONFIG = config


@contextlib.contextmanager
def talking(what: str):
    """Fixture work that can take minutes (training canaries on a fresh clone) is shown as it
    happens: output capture is suspended so the progress bar reaches the terminal, and the time it
    took is printed after. A silent 30-minute setup looks like a hang."""
    capman = _PYTEST_CONFIG.pluginmanager.get_plugin("capturemanager") if _PYTEST_CONFIG else None
    cm = capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()
    t0 = time.monotonic()
    with cm:
        print(f"\n[fixtures] {what} ...", file=sys.stderr, flush=True)
        yield
        print(f"[fixtures] {what}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


def _dev_model(size: str, seed: int = 0) -> Path:
    from lorafarm.dev.model import write_dev_model

    path = CACHE / f"devmodel-{size}-s{seed}"
    stamp = path / "lorafarm_devmodel.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == {"size": size, "seed": seed}):
        with talking(f"generating the dev model {path.name}"):
            write_dev_model(path, size=size, seed=seed, force=True)
    return path


@pytest.fixture(scope="session")
def dev_model() -> Path:
    """The tiny dev model (Llama architecture, GQA, float32)."""
    return _dev_model("tiny")


@pytest.fixture(scope="session")
def dev_model_b() -> Path:
    """A second tiny dev model (another seed): a different base, for mismatch and mixed-farm tests."""
    return _dev_model("tiny", seed=1)


_canaries_made = 0  # the most canaries made in this session: markers.json never lists fewer


def _missing(dev_model: Path, count: int) -> int:
    """How many of the first `count` canaries the cache lacks (for the progress message only)."""
    return sum(not (CANARY_DIR / f"c{i:04d}" / "cache_key").exists() for i in range(count))


def make_canaries(dev_model: Path, count: int) -> dict[str, dict]:
    """The first `count` canaries, trained once into the shared cache (keyed by content: kept
    across sessions) and reused by every test; returns their index. A test asks for no more than it
    needs: the archive tests train 9, the farm tests 16, only the engine's batch tests 32."""
    global _canaries_made
    from lorafarm.dev.adapters import write_dev_adapters

    n = max(count, _canaries_made)
    todo = _missing(dev_model, n)
    if todo:
        with talking(f"training {todo} canary adapters with PEFT into {CANARY_DIR} (cached for later runs)"):
            index = write_dev_adapters(dev_model, CANARY_DIR, count=n, progress=True)
    else:
        index = write_dev_adapters(dev_model, CANARY_DIR, count=n, progress=False)
    _canaries_made = n
    return {name: info for name, info in sorted(index.items())[:count]}


@pytest.fixture(scope="session")
def canaries(dev_model: Path) -> Path:
    """32 canary adapters on the tiny dev model; markers.json maps name -> marker, rank, modules."""
    make_canaries(dev_model, CANARY_COUNT)
    return CANARY_DIR


@pytest.fixture(scope="session")
def canary_index(canaries: Path) -> dict[str, dict]:
    return dict(sorted(json.loads((canaries / "markers.json").read_text()).items())[:CANARY_COUNT])


@pytest.fixture(scope="session")
def few_canaries(dev_model: Path) -> tuple[Path, dict[str, dict]]:
    """(folder, index) of the first 9 canaries (ranks 8/16/32 x module sets all/attention/mlp): for
    tests that need a few real adapters, not the 32 of the batch tests."""
    return CANARY_DIR, make_canaries(dev_model, 9)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API (moto's server mode) on 127.0.0.1; our aioboto3 code talks to it unchanged."""
    from moto.server import ThreadedMotoServer

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the moto server; yields its name."""
    import uuid

    import boto3

    name = f"lorafarm-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name
