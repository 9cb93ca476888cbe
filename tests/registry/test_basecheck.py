"""Base check on upload: an adapter must say which base it was trained on. An adapter trained on a
same-shape other base (the dev model with another seed) is refused; one without a hash is refused
unless the caller waives the check explicitly (`--assume-base`)."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafarm.cli import main
from tests.registry.helpers import ADMIN_TOKEN, live_server, make_adapter, unique, upload_files
from tests.registry.test_bad_input import snapshot


@pytest.fixture(scope="module")
def other_hash(dev_model_b) -> str:
    from archives.basehash import base_model_hash

    return base_model_hash(dev_model_b)


async def _tenant(client) -> str:
    name = unique("bc")
    assert (await client.post("/internal/tenants", json={"name": name})).status_code == 201
    return name


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


async def test_upload_needs_the_trained_base(client, base_config, base_hash, other_hash, tmp_path):
    assert other_hash != base_hash  # same shapes, other weights
    tenant = await _tenant(client)
    before = await snapshot(client)

    # Trained on the other base (recorded beside it, or sent as the form field): refused, naming both.
    other = make_adapter(tmp_path / "other", base_config, seed=5, trained_on=other_hash)
    err = _error(await client.post("/internal/adapters/upload", data={"tenant_id": tenant},
                                   files=upload_files(other)), 422, "base_mismatch")
    assert other_hash in err["message"]
    plain = make_adapter(tmp_path / "plain", base_config, seed=6)
    err = _error(await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "base_model": base_hash,
                                                                       "base_model_hash": other_hash},
                                   files=upload_files(plain)), 422, "base_mismatch")
    assert other_hash in err["message"] and base_hash in err["message"]
    # No hash at all: refused, and the message says how to get one.
    err = _error(await client.post("/internal/adapters/upload", data={"tenant_id": tenant},
                                   files=upload_files(plain)), 422, "base_model_hash_required")
    assert "lorafarm archive basehash" in err["message"] and "assume_base" in err["message"]
    # Malformed hash; a field that disagrees with the file sent beside the adapter.
    _error(await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "base_model_hash": "md5:x"},
                             files=upload_files(plain)), 400, "validation_error")
    _error(await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "base_model_hash": base_hash},
                             files=upload_files(other)), 422, "base_mismatch")
    assert await snapshot(client) == before  # nothing registered

    # The right hash, or an explicit waiver: accepted.
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "base_model_hash": base_hash},
                          files=upload_files(plain))
    assert r.status_code == 201 and r.json()["base_model_hash"] == base_hash, r.text
    waived = make_adapter(tmp_path / "waived", base_config, seed=7)
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "assume_base": "true"},
                          files=upload_files(waived))
    assert r.status_code == 201, r.text


async def test_cli_basehash_and_upload_flags(make_settings, base_config, dev_model, base_hash, other_hash, tmp_path,
                                             monkeypatch, capsys):
    assert await asyncio.to_thread(main, ["archive", "basehash", str(dev_model)]) == 0
    assert capsys.readouterr().out.strip() == base_hash
    with live_server(make_settings()) as url:
        monkeypatch.setenv("LORAFARM_REGISTRY_URL", url)
        monkeypatch.setenv("LORAFARM_ADMIN_TOKEN", ADMIN_TOKEN)
        tenant = unique("bcli")
        assert await asyncio.to_thread(main, ["tenants", "create", tenant]) == 0
        capsys.readouterr()
        folder = make_adapter(tmp_path / "a", base_config, seed=11)
        upload = ["adapters", "upload", str(folder), "--tenant", tenant]

        # No hash: one line, exit 2, the way out named.
        assert await asyncio.to_thread(main, upload) == 2
        err = capsys.readouterr().err.strip()
        assert "base_model_hash is required" in err and "\n" not in err
        # Recorded beside the adapter by `archive basehash --write`, for the wrong base: refused.
        assert await asyncio.to_thread(main, ["archive", "basehash", str(tmp_path / "nope")]) == 2
        assert await asyncio.to_thread(main, ["archive", "basehash", str(dev_model), "--write", str(folder)]) == 0
        assert (folder / "base_model_hash.txt").read_text().strip() == base_hash
        (folder / "base_model_hash.txt").write_text(other_hash)
        assert await asyncio.to_thread(main, upload) == 2
        assert "trained on base" in capsys.readouterr().err
        # --trained-on the right base wins over nothing; the file must agree though: use a clean copy.
        (folder / "base_model_hash.txt").unlink()
        assert await asyncio.to_thread(main, [*upload, "--trained-on", str(dev_model)]) == 0
        first = capsys.readouterr().out.strip()
        assert first.startswith("ad-")
        second = make_adapter(tmp_path / "b", base_config, seed=12)
        assert await asyncio.to_thread(main, [*upload[:2], str(second), *upload[3:], "--assume-base"]) == 0
        assert capsys.readouterr().out.strip().startswith("ad-")
        adapters = json.loads((await asyncio.to_thread(_list, main, tenant, capsys)))
        assert {a["adapter_id"] for a in adapters} >= {first}
        assert all(a["base_model_hash"] == base_hash for a in adapters) and len(adapters) == 2


def _list(main, tenant, capsys) -> str:
    assert main(["adapters", "list", "--tenant", tenant]) == 0
    return capsys.readouterr().out
