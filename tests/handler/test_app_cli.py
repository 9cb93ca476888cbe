"""`lorafarm replica`: flag parsing and a real process (merged mode) answering over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from handler.cli import build_config, parse_pools, parse_size
from lorafarm.cli import build_parser
from lorafarm.errors import CliError
from tests.handler.conftest_service import free_port, service_archives, wait_healthy  # noqa: F401 - fixture

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sizes_and_pools():
    assert parse_size("4GiB") == 4 * 1024**3 and parse_size("512MB") == 512 * 10**6
    assert parse_size("1048576") == 1048576 and parse_size("2g") == 2 * 10**9
    assert parse_pools("8:4,16:2") == {8: 4, 16: 2}
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_pools("8-4")


def test_flags_build_the_config(dev_model, service_archives, tmp_path, monkeypatch):
    monkeypatch.delenv("LORAFARM_REGISTRY_URL", raising=False)
    monkeypatch.setenv("LORAFARM_ADMIN_TOKEN", "tok")
    args = build_parser().parse_args([
        "replica", "--id", "r7", "--base", str(dev_model), "--port", "8207", "--store-url",
        service_archives.store_url, "--trust", str(service_archives.public_key), "--adapter-catalog",
        str(service_archives.catalog), "--slots", "3", "--ram-bytes", "1GiB", "--disk-bytes", "2GiB",
        "--disk-dir", str(tmp_path), "--kv-cache-bytes", "64MiB", "--rank-limit", "32", "--max-waiting", "9",
        "--max-prefill-tokens", "1024", "--speculate", "0"])
    cfg = build_config(args)
    assert cfg.engine.max_prefill_tokens == 1024 and cfg.engine.speculate == 0
    assert cfg.replica_id == "r7" and cfg.port == 8207 and cfg.admin_token == "tok"
    assert cfg.resolved_model_name() == dev_model.name and cfg.registry_url is None
    assert cfg.slots == 3 and cfg.ram_bytes == 1024**3 and cfg.disk_bytes == 2 * 1024**3
    assert cfg.engine.kv_cache_bytes == 64 * 1024**2 and cfg.limits.rank_limit == 32 and cfg.limits.max_waiting == 9
    assert cfg.url() == "http://127.0.0.1:8207"

    def fails(*extra):
        a = build_parser().parse_args(["replica", "--base", str(dev_model), *extra])
        with pytest.raises(CliError):
            build_config(a)

    fails("--registry", "http://127.0.0.1:1")  # no trusted key
    fails("--adapter-catalog", str(service_archives.catalog), "--trust", str(service_archives.public_key))
    fails("--trust", str(tmp_path / "missing.pem"))
    fails("--max-prefill-tokens", "0")
    fails("--speculate", "-1")
    with pytest.raises(CliError):
        build_config(build_parser().parse_args(["replica", "--base", str(tmp_path)]))


def test_replica_process_in_merged_mode(dev_model, service_archives, tmp_path):
    arch = service_archives
    aid = arch.good["c0006"]
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAFARM_ADMIN_TOKEN": ""}
    env.pop("LORAFARM_REGISTRY_URL", None)
    log = open(tmp_path / "replica.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorafarm", "replica", "--id", "m0", "--base", str(dev_model), "--port", str(port),
         "--model-name", "dev-tiny", "--store-url", arch.store_url, "--trust", str(arch.public_key),
         "--adapter-catalog", str(arch.catalog), "--disk-dir", str(tmp_path / "disk"), "--merged-adapter", aid,
         "--kv-cache-bytes", "8MiB", "--rank-limit", "16", "--log-level", "warning"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, lambda: (tmp_path / "replica.log").read_text())
        body = {"model": aid, "messages": [{"role": "user", "content": "my invoice"}], "temperature": 0,
                "max_tokens": 16}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == arch.markers[aid]
        assert r.headers["x-adapter-id"] == aid and r.headers["x-adapter-tier"] == "gpu"
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "model": "dev-tiny"}, timeout=60)
        assert r.status_code == 404
        state = httpx.get(f"{url}/internal/replicas/m0/state", timeout=10).json()
        assert state["gpu_adapters"] == [aid] and state["models"] == [aid]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    # uvicorn shuts down gracefully, then re-raises the signal it caught (exit status -SIGTERM)
    assert proc.returncode in (0, -signal.SIGTERM), (tmp_path / "replica.log").read_text()[-2000:]
    assert "Traceback" not in (tmp_path / "replica.log").read_text()
