"""The registry database: async engine, migrations at start-up, and serialized write transactions.

Every write runs in `Database.write()`: one transaction that first takes the write lock, so
concurrent alias flips, uploads and heartbeats cannot interleave. On PostgreSQL the lock is the
`registry_state` row (`SELECT ... FOR UPDATE`), which also serializes several registry processes;
on SQLite (one writer at a time anyway) it is an asyncio lock, plus SQLite's busy timeout.
`bump()` inside a write increments the routing-table version.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sqlalchemy import event, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from registry.tables import RegistryState

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def make_engine(url: str) -> AsyncEngine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_async_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)


def _alembic_config(connection=None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


async def migrate(engine: AsyncEngine, revision: str = "head") -> None:
    """Bring the schema to `revision` (Alembic, programmatically; safe to run at every start)."""
    import logging

    logging.getLogger("alembic").setLevel(logging.WARNING)
    from alembic import command
    def _upgrade(sync_conn):
        command.upgrade(_alembic_config(sync_conn), revision)

    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Two registries starting at once must not both create the tables.
            await conn.exec_driver_sql("SELECT pg_advisory_xact_lock(727100)")
        await conn.run_sync(_upgrade)


class Database:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.dialect = engine.dialect.name
        self.sessions = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()  # set (then replaced) when a write here grew the version

    @classmethod
    async def open(cls, url: str, *, run_migrations: bool = True) -> Database:
        engine = make_engine(url)
        if run_migrations:
            await migrate(engine)
        return cls(engine)

    async def close(self) -> None:
        await self.engine.dispose()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as session:
            yield session

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A serialized write transaction; commits on success, rolls back on any exception. The
        audit lines of the transaction (registry.audit) are logged once it committed."""
        from registry.audit import flush_log

        if self.dialect == "sqlite":
            async with self._lock, self.sessions() as session:
                async with session.begin():
                    yield session
                flush_log(session)
        else:
            async with self.sessions() as session:
                async with session.begin():
                    await session.execute(select(RegistryState.id).where(RegistryState.id == 1).with_for_update())
                    yield session
                flush_log(session)
        if session.info.pop("bumped", False):  # committed: wake the held routing polls
            self._changed.set()
            self._changed = asyncio.Event()

    @staticmethod
    async def bump(session: AsyncSession) -> None:
        """Grow the routing-table version (inside a `write()` transaction)."""
        await session.execute(update(RegistryState).where(RegistryState.id == 1).values(version=RegistryState.version + 1))
        session.info["bumped"] = True

    async def changed(self, timeout: float) -> None:
        """Return when a write through this process grows the version, or after `timeout` s (a write
        by another registry process on the same database is seen by re-reading the version then)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def version(self) -> int:
        async with self.read() as session:
            return int((await session.execute(select(RegistryState.version).where(RegistryState.id == 1))).scalar_one())
