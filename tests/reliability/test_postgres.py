"""PostgreSQL restarted under a running registry: the registry recovers without a restart (its
pool pings connections before use), keeps its data, and while the database is down it answers
with errors rather than hanging. A private cluster (initdb in a temp dir, a free port) so nobody
else's database is restarted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from lorafarm.farm import _free_port
from tests.waiting import wait_for

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), None) if Path(
    "/usr/lib/postgresql").exists() else None

pytestmark = pytest.mark.skipif(PG_BIN is None or shutil.which("runuser") is None or os.geteuid() != 0,
                                reason="needs PostgreSQL's server binaries and root (to run them as postgres)")


def _pg(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "postgres", "--", *args], check=check, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def private_postgres():
    top = Path(tempfile.mkdtemp(prefix="lorafarm-pg-"))  # not under pytest's root-only tmp dirs
    data = top / "pg"
    data.mkdir()
    shutil.chown(top, "postgres")
    shutil.chown(data, "postgres")
    port = _free_port()
    _pg(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")
    ctl = [str(PG_BIN / "pg_ctl"), "-D", str(data), "-w", "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1"]
    _pg(*ctl, "-l", str(data / "log"), "start")
    try:
        _pg(str(PG_BIN / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-c",
            "CREATE ROLE lf LOGIN SUPERUSER PASSWORD 'lf'")
        _pg(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-O", "lf", "lf")
        yield f"postgresql+asyncpg://lf:lf@127.0.0.1:{port}/lf", ctl, data
    finally:
        _pg(*ctl, "-m", "immediate", "stop", check=False)
        shutil.rmtree(top, ignore_errors=True)


def test_registry_recovers_when_postgres_restarts(tmp_path, private_postgres):
    from archives.keys import generate_keypair

    url, ctl, data = private_postgres
    generate_keypair(tmp_path / "keys")
    port = _free_port()
    token = "t" * 32
    log = open(tmp_path / "registry.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorafarm", "registry", "--host", "127.0.0.1", "--port", str(port),
         "--database-url", url, "--store-url", f"file://{tmp_path / 'store'}",
         "--signing-key", str(tmp_path / "keys" / "private.pem")],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LORAFARM_ADMIN_TOKEN": token})  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token}"}
    try:
        wait_for(lambda: _ok(base + "/health"), 60, what="registry up")
        r = httpx.post(base + "/internal/tenants", json={"name": "before-restart"}, headers=auth, timeout=10)
        assert r.status_code == 201, r.text
        _pg(*ctl, "-m", "fast", "stop")
        down = httpx.get(base + "/internal/tenants", headers=auth, timeout=60)
        assert down.status_code >= 500 and "error" in down.json()  # an answer, not a hang
        _pg(*ctl, "-l", str(data / "log"), "start")
        # recovered without a registry restart: the stale pooled connections are replaced
        wait_for(lambda: httpx.get(base + "/internal/tenants", headers=auth, timeout=10).status_code == 200, 20,
                 what="registry answering after the database restart")
        for _ in range(5):
            listed = httpx.get(base + "/internal/tenants", headers=auth, timeout=10)
            assert listed.status_code == 200
        assert "before-restart" in {t["tenant_id"] for t in listed.json()}
        r = httpx.post(base + "/internal/tenants", json={"name": "after-restart"}, headers=auth, timeout=10)
        assert r.status_code == 201, r.text
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
