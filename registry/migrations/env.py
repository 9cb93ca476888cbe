"""Alembic environment. The registry runs migrations itself at start-up (registry.db.migrate passes
an open connection in `config.attributes["connection"]`); `alembic -c registry/migrations/alembic.ini
revision --autogenerate` also works, against $LORAFARM_DATABASE_URL."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

import registry.tables  # noqa: F401  (registers the tables on the metadata)
from sqlmodel import SQLModel

config = context.config
target_metadata = SQLModel.metadata


def _include_object(obj, name, type_, reflected, compare_to):
    # Only the registry's tables: other packages may share SQLModel.metadata.
    if type_ == "table":
        return name in {t.__tablename__ for t in registry.tables.ALL_TABLES}
    return True


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_object=_include_object,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url") or os.environ.get("LORAFARM_DATABASE_URL"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    else:
        url = os.environ.get("LORAFARM_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
        asyncio.run(_run_async(url or "sqlite+aiosqlite:///var/registry.db"))
