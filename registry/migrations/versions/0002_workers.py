"""foreign workers and latency-critical models

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("url", sa.String(1024), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("api_key_env", sa.String(128), nullable=True),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "critical_models",
        sa.Column("model", sa.String(255), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("critical_models")
    op.drop_table("workers")
