"""The OpenAPI document of the router and the replica, served at /schema/openapi.json.

Both read their completion bodies raw (the router forwards them, the replica validates them with
its pydantic models), so Litestar sees no request body on those routes: the document gets the
request models' own JSON schema added for them, and a bearer-token security scheme on every route
but the public ones (/health, /metrics). schemathesis reads this document."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from pydantic import BaseModel

PUBLIC = ("/health", "/ready", "/metrics", "/schema")


def patch_document(doc: dict[str, Any], bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """Add each path's POST request body (pydantic's JSON schema) and mark the public paths."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        op = doc.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        for name, sub in js.pop("$defs", {}).items():
            schemas[name] = sub
        schemas[model.__name__] = js
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    schemas["Error"] = ERROR_SCHEMA
    for path, item in doc.get("paths", {}).items():
        for op in item.values():
            if not isinstance(op, dict):
                continue
            if path.startswith(PUBLIC):
                op["security"] = [{}]
            responses = op.setdefault("responses", {})
            # every error is an OpenAI error object, whatever its status (Litestar documents its own)
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
            for code, resp in responses.items():
                if code[:1] in "45":
                    resp["content"] = error
            responses["default"] = {"description": "an OpenAI error object", "content": error}
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
            elif path.startswith("/v1/") and "post" in item and op is item["post"]:
                ok = responses.setdefault("200", {"description": "the completion"})
                ok["content"] = {"application/json": {"schema": {"type": "object"}},
                                 "text/event-stream": {"schema": {"type": "string"}}}
    return doc


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def document(app) -> dict[str, Any]:
    """The document /schema/openapi.json serves, without a server (for schemathesis)."""
    return patch_document(app.openapi_schema.to_schema(), app.state.openapi_bodies)


def openapi_config(title: str, description: str, bodies: dict[str, type[BaseModel]], token: str) -> OpenAPIConfig:
    class _Render(JsonRenderPlugin):
        def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
            return self.render_json(request, patch_document(openapi_schema, bodies))

    return OpenAPIConfig(
        title=title,
        version="0.1.0",
        description=description,
        components=Components(security_schemes={"Bearer": SecurityScheme(type="http", scheme="bearer",
                                                                         description=token)}),
        security=[{"Bearer": []}],
        render_plugins=[_Render(), SwaggerRenderPlugin()],
        path="/schema",
    )
