"""Fixtures for the replica service tests: signed canary archives in a file:// store, a standalone
catalog, and real uvicorn servers on 127.0.0.1 (each in its own thread with its own event loop).

Import the fixtures into a test module with `from tests.handler.conftest_service import *`.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.waiting import wait_for, wait_until  # noqa: F401 - wait_until: for the modules that import * from here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 in a daemon thread (lifespan on)."""

    def __init__(self, app, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServerThread":
        self.thread.start()

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during start-up (see the log above)")
            return self.server.started

        wait_for(started, timeout, what=f"uvicorn serving on {self.url}", interval=0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class ReplicaServer(ServerThread):
    """A replica (`handler.serving.app.create_app(config)`) served for real."""

    def __init__(self, config):
        from handler.serving.app import create_app

        port = free_port()  # never the default 8200: other services may run on this machine
        config.port = port
        self.config = config
        self.app = create_app(config)
        super().__init__(self.app, port)

    @property
    def service(self):
        return self.app.state.replica

    @property
    def cache(self):
        return self.service.handler.cache

    @property
    def engine(self):
        return self.service.handler.engine

    def internal(self, path: str) -> str:
        return f"{self.url}/internal/replicas/{self.config.replica_id}/{path}"


@dataclass
class Archives:
    """Signed canary archives in a file:// store plus the standalone catalog that points into it."""

    store_dir: Path
    store_url: str
    catalog: Path
    public_key: Path
    good: dict[str, str]  # canary name -> adapter id
    markers: dict[str, str]  # adapter id -> marker
    ranks: dict[str, int]  # adapter id -> rank
    bad_base: str  # built with dev_model_b's base hash
    bad_signature: str  # signed by a key the replica does not trust
    too_big_rank: str  # a rank-32 canary (tests run the replica with rank limit 16)


GOOD_CANARIES = ["c0000", "c0001", "c0003", "c0004", "c0006", "c0007", "c0009", "c0010"]  # ranks 8 / 16


@pytest.fixture(scope="session")
def service_archives(tmp_path_factory, dev_model, dev_model_b, canaries, canary_index) -> Archives:
    import asyncio

    from archives.basehash import base_model_hash, read_base_config
    from archives.build import build_archive
    from archives.keys import generate_keypair
    from archives.store import open_store

    root = tmp_path_factory.mktemp("replica-archives")
    priv, pub = generate_keypair(root / "keys")
    rogue_priv, _ = generate_keypair(root / "rogue")
    store_dir = root / "store"
    store_dir.mkdir()
    store = open_store(f"file://{store_dir}")
    base_hash = base_model_hash(dev_model)
    other_hash = base_model_hash(dev_model_b)
    assert base_hash != other_hash
    config = read_base_config(dev_model)
    catalog: dict[str, str] = {}
    good: dict[str, str] = {}
    markers: dict[str, str] = {}
    ranks: dict[str, int] = {}

    async def put(name: str, tenant: str, key_file, bhash: str) -> str:
        lar = root / "build" / f"{tenant}-{name}.lar"
        man = build_archive(canaries / canary_index[name]["path"], lar, private_key=key_file, tenant_id=tenant,
                            base_model_hash=bhash, base_config=config)
        key = f"adapters/{tenant}/{man.adapter_id}.lar"
        await store.put_file(key, lar)
        catalog[man.adapter_id] = store.uri_for(key)
        markers[man.adapter_id] = canary_index[name]["marker"]
        ranks[man.adapter_id] = canary_index[name]["rank"]
        return man.adapter_id

    async def build_all():
        for name in GOOD_CANARIES:
            good[name] = await put(name, "acme", priv, base_hash)
        bad_base = await put("c0000", "badbase", priv, other_hash)
        bad_sig = await put("c0001", "rogue", rogue_priv, base_hash)
        big = await put("c0002", "acme", priv, base_hash)
        await store.close()
        return bad_base, bad_sig, big

    bad_base, bad_sig, big = asyncio.run(build_all())
    cat = root / "catalog.json"
    cat.write_text(json.dumps(catalog, indent=1))
    return Archives(store_dir, f"file://{store_dir}", cat, pub, good, markers, ranks, bad_base, bad_sig, big)


def make_config(dev_model: Path, archives: Archives, disk_dir: Path, **kw):
    """A standalone ReplicaConfig reading the test catalog from the file:// store (an 8 MiB KV cache
    unless `engine` says otherwise)."""
    from handler.serving.config import REPLICA_ENGINE, Limits, ReplicaConfig

    limits = kw.pop("limits", None) or Limits(rank_limit=kw.pop("rank_limit", 16), default_max_tokens=32)
    engine = kw.pop("engine", None) or REPLICA_ENGINE.replace(kv_cache_bytes=8 * 1024 * 1024)
    return ReplicaConfig(
        base_dir=dev_model, replica_id=kw.pop("replica_id", "r0"), model_name=kw.pop("model_name", "dev-tiny"),
        store_url=archives.store_url, trust=[archives.public_key], adapter_catalog=archives.catalog,
        disk_dir=disk_dir, limits=limits, engine=engine, **kw)


def chat_body(model: str, content: str = "hello, what is my order status?", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": kw.pop("max_tokens", 16), **kw}


def sse_events(text: str) -> list:
    """Parse an SSE body into its `data:` payloads (JSON objects, or the string "[DONE]")."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_healthy(proc, url: str, log, timeout: float = 120.0, what: str = "replica") -> None:
    """Block until `url`/health answers 200 from the started process `proc`; fail with `log()` (its
    log text) as soon as it exits, or when `timeout` seconds pass."""

    def healthy() -> bool:
        assert proc.poll() is None, log()
        return httpx.get(f"{url}/health", timeout=2).status_code == 200

    wait_for(healthy, timeout, what=f"{what} healthy at {url}", logs=log)


def get_json(url: str, **kw):
    r = httpx.get(url, timeout=30, **kw)
    r.raise_for_status()
    return r.json()
