"""`lorafarm registry` as a real process: serves, answers /health, is driven by the admin CLI, and
stops cleanly on SIGTERM; flag errors are one line with exit 2."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from lorafarm.cli import main
from tests.registry.helpers import BASE_NAME, free_port, unique
from tests.waiting import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait_healthy(proc, url: str, timeout: float = 180.0) -> None:
    """The deadline only bounds a hang: starting the registry beside `stress-ng --cpu 2` took over 60 s."""

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"registry exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        return httpx.get(f"{url}/health", timeout=5).status_code == 200  # refused while starting: not yet

    wait_for(healthy, timeout, what=f"registry healthy at {url}")


async def test_serve_and_admin_commands(database_url, dev_model, canaries, tmp_path, monkeypatch, capsys):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAFARM_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorafarm", "registry", "--port", str(port), "--state-dir", str(state),
         "--database-url", database_url, "--base-model", f"{BASE_NAME}={dev_model}", "--rank-limit", "32",
         "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        await asyncio.to_thread(_wait_healthy, proc, url)
        token = (state / "admin-token").read_text().strip()  # generated: none was given
        assert (state / "admin-token").stat().st_mode & 0o077 == 0
        assert (state / "registry-signing-key" / "private.pem").exists()
        assert httpx.get(f"{url}/internal/tenants").status_code == 401

        monkeypatch.setenv("LORAFARM_REGISTRY_URL", url)
        monkeypatch.setenv("LORAFARM_ADMIN_TOKEN", token)
        tenant = unique("srv")
        assert await asyncio.to_thread(main, ["tenants", "create", tenant]) == 0
        assert capsys.readouterr().out.strip().startswith("lf-")
        assert await asyncio.to_thread(main, ["adapters", "upload", str(canaries / "c0019"), "--tenant", tenant,
                                              "--alias", f"{tenant}/a:prod"]) == 0
        adapter_id = capsys.readouterr().out.strip()
        table = httpx.get(f"{url}/internal/routing", headers={"Authorization": f"Bearer {token}"}).json()
        assert table["aliases"][f"{tenant}/a:prod"]["adapter_id"] == adapter_id and table["rank_limit"] == 32
        # The store defaulted to <state-dir>/store.
        assert list((state / "store").rglob(f"{adapter_id}.lar"))
        assert httpx.get(f"{url}/schema/openapi.json").json()["info"]["title"] == "lorafarm registry"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # uvicorn shuts down gracefully, then re-raises the captured SIGTERM (exit -15 by design).
    assert proc.returncode in (0, -signal.SIGTERM)
    assert b"Traceback" not in proc.stderr.read()


@pytest.mark.parametrize("argv, words", [
    (["registry", "--base-model", "no-equals-sign"], "NAME=DIR"),
    (["registry", "--base-model", "x=/nonexistent/model", "--port", "1"], "config.json"),
    (["registry", "--rank-limit", "0", "--port", "1"], "rank-limit"),
    (["aliases", "set", "a/b:c"], "required"),
    # a worker's key only from LORAFARM_WORKER_KEY_*: refused before any registry call (port 9 is closed)
    (["workers", "add", "w", "--url", "http://x:1", "--kind", "openai", "--api-key-env", "LORAFARM_ADMIN_TOKEN",
      "--admin-token", "x", "--registry-url", "http://127.0.0.1:9"], "LORAFARM_WORKER_KEY_"),
    (["workers", "add", "w", "--url", "http://x:1", "--kind", "openai", "--api-key-env", "HOME",
      "--admin-token", "x", "--registry-url", "http://127.0.0.1:9"], "--api-key-env 'HOME' is refused"),
])
def test_flag_errors_are_one_line(argv, words, capsys, monkeypatch):
    with pytest.raises(SystemExit) if "required" in words or "NAME=DIR" in words else _nullcontext():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_admin_command_without_token(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("LORAFARM_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("LORAFARM_REGISTRY_URL", raising=False)
    monkeypatch.setenv("LORAFARM_FARM_JSON", str(tmp_path / "missing.json"))
    assert main(["tenants", "create", "acme"]) == 2
    assert "no admin token" in capsys.readouterr().err
    assert main(["tenants", "create", "acme", "--admin-token", "x", "--registry-url", "http://127.0.0.1:9"]) == 2
    assert "unreachable" in capsys.readouterr().err


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
