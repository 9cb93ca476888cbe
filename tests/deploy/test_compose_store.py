"""The compose farm's S3 object keys carry one `adapters/` prefix (issue 37: the store URL was
s3://lorafarm/adapters and the registry's keys start with adapters/, so archives landed under
s3://lorafarm/adapters/adapters/...), and archives a farm wrote under the doubled key stay readable
by the registry and the replicas after the change.

A real registry app on moto's S3 server (the suite's s3_endpoint), with the store URL of
deploy/compose.yaml, on the test's own bucket."""

from __future__ import annotations

from urllib.parse import urlparse

import boto3
import pytest
import yaml

from tests.deploy.test_compose_env import COMPOSE
from tests.registry.helpers import ADMIN_TOKEN, BASE_NAME, app_client, make_adapter, unique, upload_files

OLD_PREFIX = "adapters"  # the store URL's path before issue 37


def compose_store_url() -> str:
    urls = {svc.get("environment", {}).get("LORAFARM_STORE_URL")
            for svc in yaml.safe_load(COMPOSE.read_text())["services"].values()} - {None}
    assert len(urls) == 1, urls  # every service that has the store names the same one
    return urls.pop()


def on_bucket(url: str, bucket: str) -> str:
    """`url` (s3://bucket[/prefix]) on the test's bucket."""
    return f"s3://{bucket}{urlparse(url).path.rstrip('/')}"


def objects(endpoint: str, bucket: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


@pytest.fixture
def settings_for(tmp_path, s3_endpoint, dev_model):
    from registry.settings import RegistrySettings

    def make(store_url: str) -> RegistrySettings:
        return RegistrySettings(
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}", store_url=store_url,
            s3_endpoint_url=s3_endpoint, admin_token=ADMIN_TOKEN, signing_key=tmp_path / "keys" / "private.pem",
            base_models={BASE_NAME: str(dev_model)}, state_dir=tmp_path,
        )

    return make


async def _upload(client, folder) -> dict:
    tenant = unique()
    assert (await client.post("/internal/tenants", json={"name": tenant})).status_code == 201
    r = await client.post("/internal/adapters/upload", data={"tenant_id": tenant, "base_model": BASE_NAME},
                          files=upload_files(folder))
    assert r.status_code == 201, r.text
    return r.json()


async def test_one_adapters_prefix_and_the_doubled_keys_still_read(settings_for, s3_endpoint, s3_bucket, dev_model,
                                                                   tmp_path):
    """A farm that ran with the old store URL wrote its archive under adapters/adapters/...; the
    registry (same database) with the compose store URL then writes new archives under adapters/...
    once, and it and a replica's store fetch read both."""
    import hashlib
    import json

    from archives.basehash import base_model_hash
    from archives.store import open_store
    from handler.adapters.sources.store import StoreFetch

    folder = make_adapter(tmp_path / "a", json.loads((dev_model / "config.json").read_text()),
                          trained_on=base_model_hash(dev_model))
    async with app_client(settings_for(f"s3://{s3_bucket}/{OLD_PREFIX}")) as client:
        old = await _upload(client, folder)
    doubled = f"{OLD_PREFIX}/adapters/{old['tenant_id']}/{old['adapter_id']}.lar"
    assert old["weights_uri"] == f"s3://{s3_bucket}/{doubled}"  # what the old URL made
    assert objects(s3_endpoint, s3_bucket) == [doubled]

    new_url = on_bucket(compose_store_url(), s3_bucket)
    async with app_client(settings_for(new_url)) as client:
        got = await client.get(f"/internal/adapters/{old['adapter_id']}/archive")
        assert got.status_code == 200, got.text
        assert "sha256:" + hashlib.sha256(got.content).hexdigest() == old["checksum"]
        fresh = await _upload(client, make_adapter(tmp_path / "b", json.loads((dev_model / "config.json").read_text()),
                                                   seed=1, trained_on=base_model_hash(dev_model)))
        key = f"adapters/{fresh['tenant_id']}/{fresh['adapter_id']}.lar"
        assert fresh["weights_uri"] == f"s3://{s3_bucket}/{key}"
        assert objects(s3_endpoint, s3_bucket) == sorted([doubled, key])
        got = await client.get(f"/internal/adapters/{fresh['adapter_id']}/archive")
        assert got.status_code == 200 and got.headers["x-checksum"] == fresh["checksum"]

    store = open_store(new_url, endpoint_url=s3_endpoint)  # the replica's store, from its settings
    try:
        path = await StoreFetch(store).fetch_uri(old["adapter_id"], old["weights_uri"], tmp_path / "r0" / "x.lar")
        assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == old["checksum"]
    finally:
        await store.close()
