"""progressive deploys (issue 38): alias traffic splits, adapter tags, rollouts, per-version stats

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("aliases") as batch:
        batch.add_column(sa.Column("split", sa.JSON, nullable=True))
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("tags", sa.JSON, nullable=True))
    op.create_table(
        "rollouts",
        sa.Column("rollout_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("alias", sa.String(255), nullable=False),
        sa.Column("active_alias", sa.String(255), nullable=True),
        sa.Column("tenant_id", sa.String(63), nullable=False),
        sa.Column("old_adapter_id", sa.String(32), nullable=False),
        sa.Column("new_adapter_id", sa.String(32), nullable=False),
        sa.Column("steps", sa.JSON, nullable=False),
        sa.Column("interval_s", sa.Float, nullable=False),
        sa.Column("bounds", sa.JSON, nullable=False),
        sa.Column("step_index", sa.Integer, nullable=False),
        _ts("step_started_at"),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(1024), nullable=True),
        sa.Column("breached", sa.String(32), nullable=True),
        sa.Column("last_evaluation", sa.JSON, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        _ts("finished_at", nullable=True),
        sa.UniqueConstraint("active_alias", name="uq_rollouts_active_alias"),
    )
    op.create_index("ix_rollouts_alias", "rollouts", ["alias"])
    op.create_table(
        "version_stats",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("alias", sa.String(255), nullable=False),
        sa.Column("adapter_id", sa.String(32), nullable=False),
        _ts("window_start"),
        _ts("window_end"),
        sa.Column("router_id", sa.String(64), nullable=True),
        sa.Column("counts", sa.JSON, nullable=False),
    )
    op.create_index("ix_version_stats_alias", "version_stats", ["alias"])
    op.create_index("ix_version_stats_window_start", "version_stats", ["window_start"])


def downgrade() -> None:
    op.drop_index("ix_version_stats_window_start", table_name="version_stats")
    op.drop_index("ix_version_stats_alias", table_name="version_stats")
    op.drop_table("version_stats")
    op.drop_index("ix_rollouts_alias", table_name="rollouts")
    op.drop_table("rollouts")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("tags")
    with op.batch_alter_table("aliases") as batch:
        batch.drop_column("split")
