"""The client's tests run against a real registry (uvicorn in a thread) on SQLite and PostgreSQL:
the registry suite's fixtures (tests/registry/conftest.py) are reused as they are."""

from tests.registry.conftest import (  # noqa: F401  (pytest fixtures)
    base_config,
    base_hash,
    database_url,
    make_settings,
    registry_dir,
)
