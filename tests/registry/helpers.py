"""Helpers of the registry tests (imported by conftest and test modules)."""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from tests import waiting

POSTGRES_URL = os.environ.get("LORAFARM_TEST_POSTGRES_URL")
ADMIN_TOKEN = "test-admin-token-0123456789"
BASE_NAME = "lorafarm-dev-tiny"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

REGISTRY_TABLES = ["rollouts", "version_stats", "audit_log", "registry_state", "replicas", "adapter_stats", "placements", "aliases", "adapters",
                   "api_keys", "tenants", "workers", "critical_models", "alembic_version"]


async def reset_postgres(url: str) -> None:
    """Drop the registry's tables (the next app start migrates a fresh schema)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            for table in REGISTRY_TABLES:
                await conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{table}" CASCADE')
    finally:
        await engine.dispose()


@asynccontextmanager
async def app_client(settings):
    """A Litestar AsyncTestClient on a fresh app (lifespan run: migrations, store, key)."""
    from litestar.testing import AsyncTestClient

    from registry.app import create_app

    app = create_app(settings)
    async with AsyncTestClient(app, base_url="http://registry.test", timeout=60) as client:
        client.headers.update(AUTH)
        yield client


def unique(prefix: str = "t") -> str:
    """A fresh tenant id (tests share a module database)."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def make_adapter(dest: Path, base_config: dict, *, rank: int = 8, modules=("q_proj", "v_proj"), seed: int = 0,
                 alpha: float | None = None, trained_on: str | None = None) -> Path:
    """A small valid PEFT LoRA folder for `base_config` (random weights): for ranks the canaries
    lack and for many distinct adapters. `trained_on`: a base hash to record beside it."""
    import numpy as np
    from safetensors.numpy import save_file

    from archives.peft_dir import module_shapes

    shapes = module_shapes(base_config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(base_config["num_hidden_layers"]):
        for m in modules:
            block = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fin, fout = shapes[m]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, fin), dtype=np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fout, rank), dtype=np.float32)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": list(modules),
        "bias": "none", "task_type": "CAUSAL_LM",
    }))
    if trained_on:
        (dest / "base_model_hash.txt").write_text(trained_on + "\n")
    return dest


def upload_files(peft_dir: Path) -> list:
    """The multipart files of an upload: the adapter and the base hash recorded beside it."""
    return [
        ("files", (name, (peft_dir / name).read_bytes(), "application/octet-stream"))
        for name in ("adapter_config.json", "adapter_model.safetensors", "base_model_hash.txt")
        if (peft_dir / name).exists()
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(settings):
    """The registry app served by a real uvicorn on 127.0.0.1 (own thread and event loop), on a
    port the OS picks; yields the base URL."""
    import uvicorn

    from registry.app import create_app

    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning",
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="registry-uvicorn", daemon=True)
    thread.start()
    waiting.wait_for(lambda: server.started or not thread.is_alive(), 60, interval=0.05,
                     what="the registry server started")
    if not server.started:
        raise RuntimeError("the registry server did not start (its thread ended)")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
