"""Shared pieces of the controllers: the admin guard, the context dependency, documented errors."""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec

from registry.alias_ops import split_of
from registry.context import RegistryContext
from registry.errors import ApiError
from registry.schemas import ErrorBody
from registry.tables import Adapter, Alias, Replica, as_utc


def admin_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    ctx: RegistryContext = connection.app.state.registry
    if not ctx.admin_ok(connection.headers.get("authorization")):
        raise ApiError(401, "missing or wrong admin token: send Authorization: Bearer <admin token>",
                       code="invalid_admin_token")


def reject_unknown_query(request, *allowed: str) -> None:
    """400 for query parameters the endpoint does not define (a typo must not silently widen a list),
    and for one given twice (which one would count?)."""
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise ApiError(400, f"unknown query parameter(s): {', '.join(repr(u) for u in unknown)}",
                       code="validation_error", param=unknown[0])
    repeated = sorted(k for k in set(request.query_params) if len(request.query_params.getall(k)) > 1)
    if repeated:
        raise ApiError(400, f"query parameter {repeated[0]!r} given more than once", code="validation_error",
                       param=repeated[0])


def get_ctx(state: State) -> RegistryContext:  # dependency "ctx"
    return state.registry


def errors(*codes: int) -> dict[int, ResponseSpec]:
    """OpenAPI entries for the error answers a handler can give (all OpenAI error objects)."""
    descriptions = {
        400: "malformed request",
        401: "missing or wrong bearer token",
        404: "not found",
        409: "conflict with the current state",
        413: "request body too large",
        422: "request understood but refused (failed a check)",
    }
    return {
        c: ResponseSpec(data_container=ErrorBody, description=descriptions.get(c, "error"), generate_examples=False)
        for c in (400, 401, *codes)
    }


def adapter_out(row: Adapter) -> dict:
    return {
        "adapter_id": row.adapter_id,
        "tenant_id": row.tenant_id,
        "version": row.version,
        "base_model_hash": row.base_model_hash,
        "rank": row.rank,
        "alpha": row.alpha,
        "target_modules": list(row.target_modules or []),
        "size_bytes": row.size_bytes,
        "weights_uri": row.weights_uri,
        "checksum": row.checksum,
        "status": row.status,
        "created_at": as_utc(row.created_at),
        "tags": dict(row.tags or {}),
    }


def alias_out(row: Alias, rollout_id: int | None = None) -> dict:
    return {
        "alias": row.alias,
        "tenant_id": row.tenant_id,
        "adapter_id": row.adapter_id,
        "previous_adapter_id": row.previous_adapter_id,
        "updated_at": as_utc(row.updated_at),
        "split": split_of(row),
        "rollout_id": rollout_id,
    }


def replica_out(row: Replica) -> dict:
    return {
        "replica_id": row.replica_id,
        "url": row.url,
        "base_model_hash": row.base_model_hash,
        "models": list(row.models or []),
        "capacity_weight": row.capacity_weight,
        "last_seen": as_utc(row.last_seen),
        "status": row.status,
    }
