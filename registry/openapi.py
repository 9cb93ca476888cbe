"""The registry's OpenAPI document.

Litestar derives it from the handlers, but (2.25) drops some pydantic constraints of request
bodies: `Field(pattern=...)` and bounds on optional numbers. The request-body components are
therefore replaced by pydantic's own JSON schema of the same models, so the document states
exactly what the server validates (schemathesis relies on it)."""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Request
from litestar.openapi.plugins import JsonRenderPlugin

from lorafarm.schemas import ReplicaState
from registry.schemas import AdapterRegister, AdapterWindow, AliasSet, ReplicaJoin, StatsIn, TenantCreate, VerifyRequest

REQUEST_MODELS = [TenantCreate, VerifyRequest, AdapterRegister, AliasSet, ReplicaJoin, StatsIn, AdapterWindow, ReplicaState]


def patch_document(doc: dict[str, Any]) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in REQUEST_MODELS:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        for name, sub in js.pop("$defs", {}).items():
            schemas[name] = sub
        schemas[model.__name__] = js
    return doc


def openapi_document(app: Litestar) -> dict[str, Any]:
    """The document served at /schema/openapi.json."""
    return patch_document(app.openapi_schema.to_schema())


class RegistryJsonRenderPlugin(JsonRenderPlugin):
    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return self.render_json(request, patch_document(openapi_schema))
