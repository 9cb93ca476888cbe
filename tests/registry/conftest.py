"""Registry fixtures: every database-backed test runs on SQLite and on PostgreSQL.

PostgreSQL runs when LORAFARM_TEST_POSTGRES_URL is set (CI's .ci/run starts one and sets it);
without it the postgres variants are reported as skipped, with the reason. Each test module gets
a fresh schema: a new SQLite file, or PostgreSQL with the registry's tables dropped first.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.registry.helpers import ADMIN_TOKEN, BASE_NAME, POSTGRES_URL, app_client, reset_postgres

DB_PARAMS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "postgres",
        id="postgres",
        marks=[
            pytest.mark.postgres,
            pytest.mark.skipif(
                not POSTGRES_URL, reason="LORAFARM_TEST_POSTGRES_URL is not set (CI sets it: see .ci/run)"
            ),
        ],
    ),
]


@pytest.fixture(scope="module", params=DB_PARAMS)
async def database_url(request, tmp_path_factory) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('registry-db') / 'registry.db'}"
    else:
        await reset_postgres(POSTGRES_URL)
        yield POSTGRES_URL


@pytest.fixture(scope="module")
def registry_dir(tmp_path_factory) -> Path:
    """Per-module folder: the file store and the signing key."""
    return tmp_path_factory.mktemp("registry")


@pytest.fixture(scope="module")
def make_settings(database_url, registry_dir, dev_model):
    """RegistrySettings for this module's database, file store and signing key; overrides apply."""
    from registry.settings import RegistrySettings

    def make(**overrides):
        values = dict(
            database_url=database_url,
            store_url=(registry_dir / "store").as_uri(),
            admin_token=ADMIN_TOKEN,
            signing_key=registry_dir / "keys" / "private.pem",
            base_models={BASE_NAME: str(dev_model)},
            state_dir=registry_dir,
            sweep_interval_s=0.5,
        )
        values.update(overrides)
        return RegistrySettings(**values)

    return make


@pytest.fixture(scope="module")
async def client(make_settings):
    """The module's shared test client (default settings)."""
    async with app_client(make_settings()) as c:
        yield c


@pytest.fixture(scope="module")
def base_hash(dev_model) -> str:
    from archives.basehash import base_model_hash

    return base_model_hash(dev_model)


@pytest.fixture(scope="session")
def base_config(dev_model) -> dict:
    return json.loads((dev_model / "config.json").read_text())
