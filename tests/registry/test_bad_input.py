"""Bad input is refused with a clear 4xx and leaves nothing behind: no object, no row."""

from __future__ import annotations

import io
import tarfile

import pytest
from sqlalchemy import func, select

from tests.registry.helpers import app_client, make_adapter, unique, upload_files


async def snapshot(client) -> dict:
    """Row counts of every table and the keys in the store (own engine and store: the app's live on
    the test client's event loop)."""
    from archives.store import open_store
    from registry.db import make_engine
    from registry.tables import ALL_TABLES

    settings = client.app.state.registry.settings
    engine = make_engine(settings.database_url)
    try:
        async with engine.connect() as conn:
            counts = {t.__tablename__: (await conn.execute(select(func.count()).select_from(t))).scalar_one()
                      for t in ALL_TABLES}
    finally:
        await engine.dispose()
    async with open_store(settings.store_url, endpoint_url=settings.s3_endpoint_url) as store:
        objects = await store.list()
    return {"rows": counts, "objects": objects}


def assert_error(response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    for w in words:
        assert w in err["message"], err["message"]
    return err


@pytest.fixture(scope="module")
async def tenant(client) -> str:
    name = unique("bad")
    assert (await client.post("/internal/tenants", json={"name": name})).status_code == 201
    return name


@pytest.fixture(scope="module")
async def stored_archive(client, tenant, canaries, base_hash, tmp_path_factory):
    """A valid signed archive put in the registry's store by a 'training pipeline' (not registered)."""
    from archives.build import build_archive
    from archives.digest import file_sha256
    from archives.ids import adapter_id_for
    from archives.peft_dir import read_peft_dir

    from archives.store import open_store

    ctx = client.app.state.registry
    info = read_peft_dir(canaries / "c0005")
    adapter_id = adapter_id_for(tenant, info.content_checksum)
    lar = tmp_path_factory.mktemp("lar") / "a.lar"
    m = build_archive(canaries / "c0005", lar, private_key=ctx.private_key, tenant_id=tenant, adapter_id=adapter_id,
                      version=1, base_model_hash=base_hash)
    key = f"pipeline/{tenant}/{adapter_id}.lar"
    async with open_store(ctx.settings.store_url) as store:
        await store.put_file(key, lar)
    body = {
        "adapter_id": adapter_id, "tenant_id": tenant, "version": 1, "base_model_hash": base_hash,
        "rank": m.rank, "alpha": m.alpha, "target_modules": list(m.target_modules),
        "weights_uri": ctx.store.uri_for(key), "checksum": file_sha256(lar),
    }
    return body


async def test_register_wrong_base_hash(client, stored_archive):
    before = await snapshot(client)
    r = await client.post("/internal/adapters", json={**stored_archive, "base_model_hash": "sha256:" + "ab" * 32})
    assert_error(r, 422, "not served")
    assert await snapshot(client) == before


async def test_register_bad_checksum(client, stored_archive):
    before = await snapshot(client)
    r = await client.post("/internal/adapters", json={**stored_archive, "checksum": "sha256:" + "0" * 64})
    assert_error(r, 422, "checksum mismatch")
    assert await snapshot(client) == before


@pytest.mark.parametrize("uri", [
    "http://attacker.example/adapter.lar",
    "https://attacker.example/adapter.lar",
    "file:///etc/passwd",
    "file:///tmp/elsewhere/adapters/x.lar",
    "s3://another-bucket/adapters/x.lar",
    "ftp://x/y.lar",
    "adapters/../../etc/passwd",
])
async def test_register_uri_outside_store(client, stored_archive, uri):
    before = await snapshot(client)
    r = await client.post("/internal/adapters", json={**stored_archive, "weights_uri": uri})
    assert_error(r, 422, "outside")
    assert await snapshot(client) == before


async def test_register_missing_object_and_manifest_mismatch(client, stored_archive):
    ctx = client.app.state.registry
    before = await snapshot(client)
    r = await client.post("/internal/adapters", json={**stored_archive, "weights_uri": ctx.store.uri_for("nope/x.lar")})
    assert_error(r, 422, "no object")
    r = await client.post("/internal/adapters", json={**stored_archive, "rank": 4})
    assert_error(r, 422, "rank")
    r = await client.post("/internal/adapters", json={**stored_archive, "tenant_id": "nobody-here"})
    assert_error(r, 422, "tenant")
    assert await snapshot(client) == before


async def test_register_then_conflict(client, stored_archive):
    r = await client.post("/internal/adapters", json=stored_archive)
    assert r.status_code == 201, r.text
    assert r.json()["size_bytes"] > 0 and r.json()["status"] == "active"
    r = await client.post("/internal/adapters", json=stored_archive)  # same again: idempotent
    assert r.status_code == 200
    before = await snapshot(client)
    r = await client.post("/internal/adapters", json={**stored_archive, "checksum": "sha256:" + "1" * 64})
    assert r.status_code in (409, 422)
    assert await snapshot(client) == before


async def test_rank_above_limit(make_settings, tenant, base_config, tmp_path, stored_archive, base_hash):
    rank64 = make_adapter(tmp_path / "r64", base_config, rank=64, modules=("q_proj",), trained_on=base_hash)
    async with app_client(make_settings(rank_limit=16)) as c:
        before = await snapshot(c)
        r = await c.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=upload_files(rank64))
        assert_error(r, 422, "rank 64", "limit 16")
        r = await c.post("/internal/adapters", json={**stored_archive, "rank": 64})
        assert_error(r, 422, "rank 64", "limit 16")
        assert await snapshot(c) == before
        assert (await c.get("/internal/routing")).json()["rank_limit"] == 16


async def test_upload_pickle_refused(client, tenant, canaries, tmp_path):
    before = await snapshot(client)
    config = (canaries / "c0000" / "adapter_config.json").read_bytes()
    files = [("files", ("adapter_config.json", config, "application/json")),
             ("files", ("adapter_model.bin", b"\x80\x04\x95 pickle bytes", "application/octet-stream"))]
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=files)
    assert_error(r, 422, "pickle")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("adapter/adapter_config.json", config), ("adapter/adapter_model.bin", b"\x80\x04K\x01.")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant},
                          files=[("archive", ("adapter.tar", buf.getvalue(), "application/x-tar"))])
    assert_error(r, 422, "pickle")
    assert await snapshot(client) == before


async def test_upload_bad_content(client, tenant, canaries, base_hash, dev_model_b):
    from archives.basehash import base_model_hash

    before = await snapshot(client)
    good = upload_files(canaries / "c0000")
    cases = [
        ({"tenant_id": "no-such-tenant"}, good, 422, "tenant"),
        ({"tenant_id": tenant, "base_model": "sha256:" + "cd" * 32}, good, 422, "not served"),
        ({"tenant_id": tenant, "base_model": base_model_hash(dev_model_b)}, good, 422, "not served"),
        ({"tenant_id": tenant, "base_model": "gpt-17"}, good, 422, "not served"),
        ({"tenant_id": tenant, "alias": "someone-else/x:prod"}, good, 422, "belongs to tenant"),
        ({"tenant_id": tenant, "alias": "no-slash"}, good, 422, "alias"),
        ({"tenant_id": tenant}, [good[0], good[2]], 422, "adapter_model.safetensors"),
        ({"tenant_id": tenant}, [good[0], ("files", ("adapter_model.safetensors", b"not safetensors", "x/y")), good[2]],
         422, "invalid adapter"),
        ({"tenant_id": tenant}, [("files", ("adapter_config.json", b'{"peft_type": "PROMPT"}', "x/y")), *good[1:]], 422,
         "LORA"),
        ({"tenant_id": tenant, "version": "zero"}, good, 400, "version"),
        ({"tenant_id": "Not A Slug"}, good, 400, "tenant_id"),
    ]
    for data, files, status, word in cases:
        r = await client.post("/internal/adapters/upload", data=data, files=files)
        assert_error(r, status, word)
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant})
    assert r.status_code == 400
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=[
        ("archive", ("x.tar", b"this is not a tar file at all" * 20, "application/x-tar"))])
    assert_error(r, 422, "tar")
    assert await snapshot(client) == before


async def test_upload_tar_with_traversal_names(client, tenant, canaries, base_hash):
    """Member names are reduced to their last part and only the two adapter files are taken:
    `../../` or absolute names cannot write outside the upload folder."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, src in (("../../adapter_config.json", "adapter_config.json"),
                          ("/abs/adapter_model.safetensors", "adapter_model.safetensors")):
            data = (canaries / "c0006" / src).read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("evil-link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "base_model_hash": base_hash},
                          files=[("archive", ("adapter.tar", buf.getvalue(), "application/x-tar"))])
    assert r.status_code == 201, r.text
    assert r.json()["rank"] == 8


async def test_alias_refusals(client, tenant, canaries):
    other = unique("oth")
    assert (await client.post("/internal/tenants", json={"name": other})).status_code == 201
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=upload_files(canaries / "c0007"))
    assert r.status_code in (200, 201), r.text
    adapter_id = r.json()["adapter_id"]
    before = await snapshot(client)
    # An alias owned by another tenant.
    assert_error(await client.put(f"/internal/aliases/{other}/app:prod", json={"adapter_id": adapter_id}), 422,
                 "belongs to tenant")
    # An unknown adapter.
    assert_error(await client.put(f"/internal/aliases/{tenant}/app:prod", json={"adapter_id": "ad-" + "0" * 20}), 422,
                 "no adapter")
    # A malformed adapter id, alias name, alias of an unknown tenant.
    assert (await client.put(f"/internal/aliases/{tenant}/app:prod", json={"adapter_id": "x"})).status_code == 400
    assert (await client.put(f"/internal/aliases/{tenant}/no-tag", json={"adapter_id": adapter_id})).status_code == 400
    assert_error(await client.put("/internal/aliases/ghost-tenant/app:prod", json={"adapter_id": adapter_id}), 422,
                 "no tenant")
    # Rollback of an unknown alias, and of one with no previous adapter.
    assert_error(await client.post(f"/internal/aliases/{tenant}/none:prod/rollback"), 404, "no alias")
    assert await snapshot(client) == before
    assert (await client.put(f"/internal/aliases/{tenant}/app:prod", json={"adapter_id": adapter_id})).status_code == 200
    assert_error(await client.post(f"/internal/aliases/{tenant}/app:prod/rollback"), 409, "no previous")


async def test_missing_or_wrong_token_everywhere(client, stored_archive, tenant):
    """Every /internal operation of the OpenAPI document answers 401 without the admin token,
    before reading the body, and writes nothing."""
    schema = (await client.get("/schema/openapi.json")).json()
    before = await snapshot(client)
    checked = 0
    for path, ops in schema["paths"].items():
        if not path.startswith("/internal"):
            continue
        url = (path.replace("{tenant_id}", tenant).replace("{key_id}", "key-1").replace("{adapter_id}", "ad-" + "1" * 20)
               .replace("{name}", "x:prod").replace("{replica_id}", "r0"))
        for method in ops:
            for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
                r = await client.request(method.upper(), url, headers=headers,
                                         json={"name": unique()} if method in ("post", "put") else None)
                assert_error(r, 401, "admin token")
                assert r.headers.get("www-authenticate") == "Bearer"
                checked += 1
    assert checked >= 3 * 19
    assert await snapshot(client) == before
    assert (await client.get("/health", headers={"Authorization": ""})).status_code == 200


async def test_tenant_and_key_refusals(client, tenant):
    before = await snapshot(client)
    assert_error(await client.post("/internal/tenants", json={"name": tenant}), 409, "already exists")
    assert (await client.post("/internal/tenants", json={"name": "UPPER case"})).status_code == 400
    assert (await client.post("/internal/tenants", json={"name": "ok-name", "requests_per_s": -1})).status_code == 400
    assert (await client.post("/internal/tenants", json={"name": "ok-name", "extra": 1})).status_code == 400
    assert_error(await client.post("/internal/tenants/ghost-x/keys"), 404, "no tenant")
    assert_error(await client.delete(f"/internal/tenants/{tenant}/keys/key-nope"), 404, "no key")
    assert_error(await client.post("/internal/auth/verify", json={"api_key": "lf-guess"}), 401, "API key")
    assert await snapshot(client) == before


async def test_failed_insert_removes_the_stored_object(make_settings, canaries):
    """Atomic upload: when the database write fails after the archive was stored, the object is
    deleted again and no row remains."""
    async with app_client(make_settings()) as c:
        tenant = unique("atom")
        assert (await c.post("/internal/tenants", json={"name": tenant})).status_code == 201
        before = await snapshot(c)
        db = c.app.state.registry.db

        async def broken_bump(session):
            raise RuntimeError("database went away")

        db.bump = broken_bump
        r = await c.post("/internal/adapters/upload", data={"tenant_id": tenant, "alias": f"{tenant}/x:prod"},
                         files=upload_files(canaries / "c0020"))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert await snapshot(c) == before
        del db.bump
        r = await c.post("/internal/adapters/upload", data={"tenant_id": tenant}, files=upload_files(canaries / "c0020"))
        assert r.status_code == 201
