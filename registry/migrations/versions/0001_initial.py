"""initial registry schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("tenant_id", sa.String(63), primary_key=True),
        sa.Column("requests_per_s", sa.Float, nullable=True),
        sa.Column("tokens_per_s", sa.Float, nullable=True),
        _ts("created_at"),
    )
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(63), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        _ts("created_at"),
        _ts("revoked_at", nullable=True),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "adapters",
        sa.Column("adapter_id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(63), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("base_model_hash", sa.String(80), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("alpha", sa.Float, nullable=False),
        sa.Column("target_modules", sa.JSON, nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("weights_uri", sa.String(1024), nullable=False),
        sa.Column("checksum", sa.String(80), nullable=False),
        sa.Column("content_checksum", sa.String(80), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("owners_k", sa.Integer, nullable=False),
        sa.Column("load_tokens_per_s", sa.Float, nullable=False),
        _ts("load_updated_at", nullable=True),
        _ts("created_at"),
    )
    op.create_index("ix_adapters_tenant_id", "adapters", ["tenant_id"])
    op.create_index("ix_adapters_base_model_hash", "adapters", ["base_model_hash"])
    op.create_table(
        "aliases",
        sa.Column("alias", sa.String(255), primary_key=True),
        sa.Column("tenant_id", sa.String(63), nullable=False),
        sa.Column("adapter_id", sa.String(32), nullable=False),
        sa.Column("previous_adapter_id", sa.String(32), nullable=True),
        _ts("updated_at"),
    )
    op.create_index("ix_aliases_tenant_id", "aliases", ["tenant_id"])
    op.create_table(
        "placements",
        sa.Column("adapter_id", sa.String(32), primary_key=True),
        sa.Column("replica_id", sa.String(128), primary_key=True),
        sa.Column("role", sa.String(8), nullable=False),
        sa.Column("tier", sa.String(8), nullable=False),
        _ts("last_used_at"),
    )
    op.create_index("ix_placements_replica_id", "placements", ["replica_id"])
    op.create_table(
        "adapter_stats",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("adapter_id", sa.String(32), nullable=False),
        _ts("window_start"),
        sa.Column("window_s", sa.Float, nullable=False),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("tokens_per_s", sa.Float, nullable=False),
        sa.Column("gpu_hit_rate", sa.Float, nullable=True),
    )
    op.create_index("ix_adapter_stats_adapter_id", "adapter_stats", ["adapter_id"])
    op.create_index("ix_adapter_stats_window_start", "adapter_stats", ["window_start"])
    op.create_table(
        "replicas",
        sa.Column("replica_id", sa.String(128), primary_key=True),
        sa.Column("url", sa.String(1024), nullable=False),
        sa.Column("base_model_hash", sa.String(80), nullable=False),
        sa.Column("models", sa.JSON, nullable=False),
        sa.Column("capacity_weight", sa.Float, nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        _ts("last_seen"),
        _ts("joined_at"),
        sa.Column("state", sa.JSON, nullable=True),
    )
    op.create_table(
        "registry_state",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(sa.table("registry_state", sa.column("id"), sa.column("version")), [{"id": 1, "version": 1}])


def downgrade() -> None:
    for table in ("registry_state", "replicas", "adapter_stats", "placements", "aliases", "adapters",
                  "api_keys", "tenants"):
        op.drop_table(table)
