"""Alembic migrations of the registry database (run programmatically by registry.db.migrate)."""
