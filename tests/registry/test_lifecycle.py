"""Lifecycle commands against a real registry process-in-thread: `lorafarm adapters disable|enable|
delete`, `aliases delete`, `keys create|rotate|revoke`, `tenants set-limits`; each command's
refusals (one line, exit 2, nothing changed) and the audit rows each change writes."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lorafarm.cli import main
from tests.registry.helpers import ADMIN_TOKEN, AUTH, live_server, unique, upload_files


@pytest.fixture
def cli(make_settings, monkeypatch, capsys):
    """run(*argv) -> (exit code, stdout, stderr) against a live registry; .url, .http for checks."""
    with live_server(make_settings()) as url:
        monkeypatch.setenv("LORAFARM_REGISTRY_URL", url)
        monkeypatch.setenv("LORAFARM_ADMIN_TOKEN", ADMIN_TOKEN)
        monkeypatch.setenv("LORAFARM_ACTOR", "alice@ops")

        class Cli:
            def __init__(self):
                self.url = url
                self.http = httpx.Client(base_url=url, headers=AUTH, timeout=30)

            async def run(self, *argv):
                capsys.readouterr()
                try:
                    code = await asyncio.to_thread(main, [str(a) for a in argv])
                except SystemExit as e:  # argparse refusals
                    code = e.code
                out = capsys.readouterr()
                return code, out.out.strip(), out.err.strip()

            def audit(self, target):
                return self.http.get("/internal/audit", params={"target": target}).json()

        c = Cli()
        try:
            yield c
        finally:
            c.http.close()


async def _refused(cli, argv, *words):
    code, out, err = await cli.run(*argv)
    assert code == 2, (argv, out, err)
    assert "\n" not in err and all(w in err for w in words), err
    return err


async def test_adapter_and_alias_lifecycle(cli, canaries):
    tenant = unique("lc")
    assert (await cli.run("tenants", "create", tenant))[0] == 0
    v1 = (await cli.run("adapters", "upload", canaries / "c0000", "--tenant", tenant, "--alias", f"{tenant}/a:prod"))[1]
    v2 = (await cli.run("adapters", "upload", canaries / "c0001", "--tenant", tenant))[1]
    spare = (await cli.run("adapters", "upload", canaries / "c0002", "--tenant", tenant))[1]
    assert (await cli.run("aliases", "set", f"{tenant}/a:prod", v2))[0] == 0  # v1 is now the rollback target

    # Delete is refused while an alias points to the adapter or would roll back to it.
    err = await _refused(cli, ["adapters", "delete", v2], "409", f"alias {tenant}/a:prod points to it")
    assert "aliases delete" in err
    await _refused(cli, ["adapters", "delete", v1], f"alias {tenant}/a:prod rolls back to it")
    await _refused(cli, ["adapters", "delete", "ad-" + "0" * 20], "404", "no adapter")
    await _refused(cli, ["adapters", "disable", "ad-" + "0" * 20], "404")
    await _refused(cli, ["aliases", "delete", f"{tenant}/nope:prod"], "404", "no alias")
    assert cli.http.get(f"/internal/adapters/{v2}").json()["status"] == "active"

    # Disable takes it out of the routing table's active set; enable brings it back.
    v0 = cli.http.get("/internal/routing").json()["version"]
    assert await cli.run("adapters", "disable", spare) == (0, f"{spare}: disabled", "")
    table = cli.http.get("/internal/routing").json()
    assert table["adapters"][spare]["status"] == "disabled" and table["version"] > v0
    assert (await cli.run("adapters", "enable", spare))[1] == f"{spare}: active"

    # Unused adapter: deleted with its archive.
    uri = cli.http.get(f"/internal/adapters/{spare}").json()["weights_uri"]
    assert (await cli.run("adapters", "delete", spare))[0] == 0
    assert cli.http.get(f"/internal/adapters/{spare}").status_code == 404
    assert cli.http.get(f"/internal/adapters/{spare}/archive").status_code == 404
    assert spare not in cli.http.get("/internal/routing").json()["adapters"]
    from pathlib import Path
    from urllib.parse import urlparse

    assert not Path(urlparse(uri).path).exists()

    # Alias deleted: then both versions may go.
    assert (await cli.run("aliases", "delete", f"{tenant}/a:prod"))[0] == 0
    assert cli.http.get(f"/internal/aliases/{tenant}/a:prod").status_code == 404
    assert f"{tenant}/a:prod" not in cli.http.get("/internal/routing").json()["aliases"]
    for a in (v1, v2):
        assert (await cli.run("adapters", "delete", a))[0] == 0

    # Audit: who, what, when, oldest last; the CLI shows the same rows.
    rows = cli.audit(spare)
    assert [r["action"] for r in rows] == ["adapter.delete", "adapter.enable", "adapter.disable", "adapter.upload"]
    assert all(r["actor"] == "alice@ops" and r["client"] == "127.0.0.1" and r["at"] for r in rows)
    alias_rows = cli.audit(f"{tenant}/a:prod")
    assert [(r["action"], r["detail"].get("adapter_id")) for r in alias_rows] == [
        ("alias.delete", v2), ("alias.set", v2), ("alias.set", v1)]
    assert alias_rows[1]["detail"]["previous_adapter_id"] == v1
    code, out, _ = await cli.run("audit", "--target", f"{tenant}/a:prod")
    assert code == 0 and len(out.splitlines()) == 3 and "alice@ops  alias.delete" in out.splitlines()[0]
    # Refusals wrote nothing.
    assert not any(r["action"] == "adapter.delete" for r in cli.audit("ad-" + "0" * 20))


async def test_keys_and_limits(cli):
    tenant = unique("keys")
    code, first_key, _ = await cli.run("tenants", "create", tenant)
    assert code == 0

    def verify(key):
        return cli.http.post("/internal/auth/verify", json={"api_key": key})

    assert verify(first_key).status_code == 200
    code, second_key, err = await cli.run("keys", "create", tenant)
    assert code == 0 and second_key.startswith("lf-") and verify(second_key).status_code == 200
    keys = json.loads((await cli.run("keys", "list", tenant))[1])
    first_id, second_id = keys[0]["key_id"], keys[1]["key_id"]

    # Rotate one key: a new key works, that one is revoked, the other stays.
    code, third_key, err = await cli.run("keys", "rotate", tenant, first_id)
    assert code == 0 and f"revoked: {first_id}" in err
    assert verify(first_key).status_code == 401 and verify(third_key).status_code == 200
    assert verify(second_key).status_code == 200
    await _refused(cli, ["keys", "rotate", tenant, first_id], "409", "already revoked")
    await _refused(cli, ["keys", "rotate", tenant, "key-nope"], "404")
    await _refused(cli, ["keys", "rotate", "no-such-tenant"], "404", "no tenant")
    # Rotate all: every live key revoked.
    code, fourth_key, err = await cli.run("keys", "rotate", tenant)
    assert code == 0 and verify(second_key).status_code == 401 and verify(third_key).status_code == 401
    assert verify(fourth_key).status_code == 200
    # Revoke.
    fourth_id = json.loads((await cli.run("keys", "list", tenant))[1])[-1]["key_id"]
    assert (await cli.run("keys", "revoke", tenant, fourth_id))[0] == 0
    assert verify(fourth_key).status_code == 401
    await _refused(cli, ["keys", "revoke", tenant, "key-nope"], "404")

    # Limits: set, keep what is not given, clear with 'none'; the router's verify answer carries them.
    code, out, _ = await cli.run("tenants", "set-limits", tenant, "--requests-per-s", "5", "--tokens-per-s", "900")
    assert code == 0 and "requests_per_s 5, tokens_per_s 900" in out
    assert (await cli.run("tenants", "set-limits", tenant, "--tokens-per-s", "none"))[0] == 0
    new_key = (await cli.run("keys", "create", tenant))[1]
    assert {k: verify(new_key).json()[k] for k in ("requests_per_s", "tokens_per_s")} == {
        "requests_per_s": 5.0, "tokens_per_s": None}
    await _refused(cli, ["tenants", "set-limits", tenant], "--requests-per-s")
    await _refused(cli, ["tenants", "set-limits", tenant, "--requests-per-s", "-1"], "0 or more")
    await _refused(cli, ["tenants", "set-limits", "no-such-tenant", "--requests-per-s", "1"], "404")
    r = cli.http.patch(f"/internal/tenants/{tenant}", json={"requests_per_s": 1, "burst": 3})
    assert r.status_code == 400

    rows = cli.audit(tenant)
    assert [r["action"] for r in rows] == ["tenant.set_limits", "tenant.set_limits", "tenant.create"]
    assert rows[0]["detail"] == {"before": {"tokens_per_s": 900.0}, "after": {"tokens_per_s": None}}
    key_actions = [r["action"] for r in cli.http.get("/internal/audit", params={"target_kind": "key"}).json()
                   if r["detail"].get("tenant_id") == tenant]
    assert key_actions == ["key.create", "key.revoke", "key.rotate", "key.rotate", "key.create"]


async def test_audit_rows_roll_back_with_the_change(client, canaries):
    """A refused change writes no audit row; the upload's row names the base it was checked against."""
    tenant = unique("ar")
    assert (await client.post("/internal/tenants", json={"name": tenant})).status_code == 201
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "alias": f"{tenant}/x:prod"},
                          files=upload_files(canaries / "c0003"))
    assert r.status_code == 201, r.text
    adapter_id = r.json()["adapter_id"]
    before = (await client.get("/internal/audit", params={"limit": 10000})).json()
    assert (await client.delete(f"/internal/adapters/{adapter_id}")).status_code == 409
    assert (await client.put(f"/internal/aliases/{tenant}/x:prod", json={"adapter_id": "ad-" + "1" * 20})).status_code == 422
    assert (await client.get("/internal/audit", params={"limit": 10000})).json() == before
    upload = (await client.get("/internal/audit", params={"target": adapter_id})).json()
    assert upload[0]["action"] == "adapter.upload" and upload[0]["detail"]["base_model_hash"].startswith("sha256:")
    assert upload[0]["actor"] == "admin"  # no x-lorafarm-actor header sent
    assert (await client.get("/internal/audit", params={"limit": 0})).status_code == 400
    assert (await client.get("/internal/audit", params={"who": "x"})).status_code == 400


async def test_access_and_audit_log_lines(client, caplog):
    """Each request is one JSON access line; polls (health, routing table) only at DEBUG; each change
    one JSON audit line after it committed."""
    import logging

    caplog.set_level(logging.DEBUG, logger="lorafarm")
    tenant = unique("log")
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/internal/routing")).status_code == 200
    assert (await client.post("/internal/tenants", json={"name": tenant})).status_code == 201
    assert (await client.post("/internal/tenants", json={"name": tenant})).status_code == 409
    access = [(r.levelno, json.loads(r.getMessage())) for r in caplog.records if r.name == "lorafarm.access"]
    by_path = [(lvl, a["method"], a["path"], a["status"]) for lvl, a in access]
    assert by_path == [(logging.DEBUG, "GET", "/health", 200), (logging.DEBUG, "GET", "/internal/routing", 200),
                       (logging.INFO, "POST", "/internal/tenants", 201), (logging.INFO, "POST", "/internal/tenants", 409)]
    assert all(a["service"] == "registry" and a["ms"] >= 0 for _, a in access)
    audits = [json.loads(r.getMessage()) for r in caplog.records if r.name == "lorafarm.audit"]
    assert [(a["action"], a["target"]) for a in audits] == [("tenant.create", tenant)]  # the 409 wrote none
