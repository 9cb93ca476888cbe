"""Shared fixtures: the generated dev model and the PEFT-trained canary adapters.

Both are cached under .cache/lorafarm (or $LORAFARM_CACHE_DIR) so repeated runs don't retrain;
the canary cache is keyed by content (see lorafarm.dev.adapters).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LORAFARM_CACHE_DIR", REPO / ".cache" / "lorafarm"))
CANARY_COUNT = 32  # batch invariance needs 32 distinct adapters


def _dev_model(size: str, seed: int = 0) -> Path:
    from lorafarm.dev.model import write_dev_model

    path = CACHE / f"devmodel-{size}-s{seed}"
    stamp = path / "lorafarm_devmodel.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == {"size": size, "seed": seed}):
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


@pytest.fixture(scope="session")
def canaries(dev_model: Path) -> Path:
    """32 canary adapters on the tiny dev model; markers.json maps name -> marker, rank, modules."""
    from lorafarm.dev.adapters import write_dev_adapters

    out = CACHE / "canaries-tiny-s0"
    write_dev_adapters(dev_model, out, count=CANARY_COUNT, progress=False)
    return out


@pytest.fixture(scope="session")
def canary_index(canaries: Path) -> dict[str, dict]:
    return json.loads((canaries / "markers.json").read_text())


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
