"""The registry Litestar app: `create_app(settings)`.

The lifespan opens the database (running the Alembic migrations), the object store and the
signing key, hashes the configured base models, and keeps them on `app.state.registry`; a
background task marks silent replicas down and lets owner counts of cooling adapters fall; another
drives the running rollouts (registry/rollout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from litestar import Litestar, Request, Response, get
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.plugins.pydantic import PydanticPlugin
from litestar.routes import HTTPRoute

from registry.context import RegistryContext, ServedBase
from registry.controllers import CONTROLLERS
from registry.errors import EXCEPTION_HANDLERS, ApiError
from registry.openapi import RegistryJsonRenderPlugin
from registry.schemas import Health
from registry.settings import RegistrySettings

log = logging.getLogger("lorafarm.registry")


def load_signing_key(path: str | Path):
    """The registry's Ed25519 private key; a new key pair is written there when the file is missing."""
    from archives.keys import generate_keypair, load_private_key

    path = Path(path)
    if not path.exists():
        generate_keypair(path.parent)
        generated = path.parent / "private.pem"
        if generated != path:
            generated.rename(path)
        log.warning("generated a new registry signing key at %s (public key beside it)", path)
    return load_private_key(path)


def load_base_models(base_models: dict) -> dict[str, ServedBase]:
    from archives.basehash import base_model_hash, read_base_config

    out = {}
    for name, folder in base_models.items():
        folder = Path(folder)
        out[name] = ServedBase(name=name, path=folder, hash=base_model_hash(folder), config=read_base_config(folder))
    return out


async def open_context(settings: RegistrySettings) -> RegistryContext:
    from archives.keys import load_public_keys
    from archives.store import open_store
    from registry.db import Database

    private_key = await asyncio.to_thread(load_signing_key, settings.signing_key)
    public_key = private_key.public_key()
    trusted = [public_key]
    if settings.trust:
        trusted += await asyncio.to_thread(load_public_keys, [str(p) for p in settings.trust])
    base_models = await asyncio.to_thread(load_base_models, settings.base_models)
    db = await Database.open(settings.database_url)
    try:
        store = open_store(settings.store_url, endpoint_url=settings.s3_endpoint_url)
    except BaseException:
        await db.close()
        raise
    return RegistryContext(settings=settings, db=db, store=store, private_key=private_key, public_key=public_key,
                           trusted_keys=trusted, base_models=base_models)


async def close_context(ctx: RegistryContext) -> None:
    try:
        await ctx.store.close()
    finally:
        await ctx.db.close()


# A JSON string escape for NUL, not itself escaped (`\\u0000` is a backslash and "u0000").
_JSON_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


async def _refuse_nul(request: Request) -> None:
    """400 for a NUL character anywhere in the path, the query or a JSON body. No id, name or
    filter of ours can hold one, and PostgreSQL's text type refuses it (a 5xx otherwise)."""
    where = None
    if "\x00" in request.scope["path"]:
        where = "the path"
    elif any("\x00" in k or "\x00" in v for k, v in request.query_params.multi_items()):
        where = "the query"
    elif request.method in ("POST", "PUT", "PATCH") and request.content_type[0] == "application/json":
        body = await request.body()
        if b"\x00" in body or _JSON_NUL.search(body):
            where = "the JSON body"
    if where:
        raise ApiError(400, f"{where} holds a NUL character", code="validation_error")


async def _before_request(request: Request) -> Response | None:
    await _refuse_nul(request)
    return _allow_header(request)


def _allow_header(request: Request) -> Response | None:
    """Answer OPTIONS with every method of the path. Litestar 2.25's automatic OPTIONS handler
    lists only the methods registered first for a path (it keeps a stale route object)."""
    if request.method != "OPTIONS":
        return None
    paths = request.route_handler.paths
    methods = {"OPTIONS"}
    for route in request.app.routes:
        if isinstance(route, HTTPRoute) and route.path in paths:
            methods.update(route.methods)
    return Response(None, status_code=204, headers={"Allow": ", ".join(sorted(methods))}, media_type="text/plain")


def create_app(settings: RegistrySettings | None = None) -> Litestar:
    settings = settings or RegistrySettings.from_env()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        ctx = await open_context(settings)
        app.state.registry = ctx
        from registry.rollout import RolloutDriver

        sweeper = asyncio.create_task(ctx.sweep_forever(), name="registry-sweep")
        driver = asyncio.create_task(RolloutDriver(ctx).run_forever(), name="registry-rollouts")
        try:
            yield
        finally:
            for task in (sweeper, driver):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await close_context(ctx)

    @get("/health", summary="Liveness (no token needed)", tags=["health"], security=[{}])
    async def health_handler(state: State) -> Health:
        ctx: RegistryContext = state.registry
        return Health(status="ok", version=await ctx.db.version())

    openapi = OpenAPIConfig(
        title="lorafarm registry",
        version="0.1.0",
        description="Control plane of lorafarm: tenants, adapters, aliases, replicas, placements.",
        components=Components(
            security_schemes={"AdminToken": SecurityScheme(type="http", scheme="bearer",
                                                           description="the registry's admin token")}
        ),
        security=[{"AdminToken": []}],
        render_plugins=[RegistryJsonRenderPlugin(), SwaggerRenderPlugin()],
        path="/schema",
    )
    from lorafarm.accesslog import access_log_middleware

    return Litestar(
        route_handlers=[health_handler, *CONTROLLERS],
        lifespan=[lifespan],
        middleware=[access_log_middleware("registry")],
        exception_handlers=EXCEPTION_HANDLERS,
        before_request=_before_request,
        plugins=[PydanticPlugin(validate_strict=True)],  # no bool-as-int or str-as-number coercion
        openapi_config=openapi,
        debug=False,
        logging_config=None,  # leave logging to uvicorn / the embedding process
    )
