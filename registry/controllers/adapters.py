"""Adapters: register an archive already in the store, upload a PEFT adapter (the registry builds,
signs and stores the archive), get/list, and archive download for replicas."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Annotated

from litestar import Controller, Request, Response, delete, get, post
from litestar.di import Provide
from litestar.enums import RequestEncodingType
from litestar.params import Body, Parameter
from litestar.response import Stream
from sqlalchemy import delete as sql_delete
from sqlalchemy import func, or_, select

from archives.basehash import TRAINED_BASE_FILE
from registry import audit
from registry.alias_ops import split_ids
from registry.context import RegistryContext
from registry.controllers.aliases import apply_alias, check_alias_name
from registry.controllers.common import adapter_out, admin_guard, errors, get_ctx, reject_unknown_query
from registry.errors import ApiError
from registry.schemas import (
    TENANT_ID_PATTERN,
    AdapterOut,
    AdapterRegister,
    AdapterUploaded,
    AdapterUploadForm,
)
from registry.tables import Adapter, AdapterStat, Alias, Placement, Tenant, utcnow

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PAYLOAD = (CONFIG_NAME, WEIGHTS_NAME)
ACCEPTED = (*PAYLOAD, TRAINED_BASE_FILE)  # base_model_hash.txt: the base it was trained on, if recorded
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_TENANT_RE = re.compile(TENANT_ID_PATTERN)
log = logging.getLogger("lorafarm.registry")
# Unknown and malformed ids alike answer 404 (a replica asking for an id that is not ours gets "not found").
AdapterId = Parameter(max_length=128, description="adapter id (ad- + 20 hex)")
MAX_UPLOAD_BODY = 4 * 1024**3  # the whole multipart body; each file is also capped by settings.max_upload_bytes


def _refuse_pickle(name: str) -> None:
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise ApiError(
            422,
            f"{name}: pickle weights are refused (they can run code when loaded); "
            "upload adapter_model.safetensors (save with safe_serialization=True)",
            code="pickle_refused",
        )


async def _save_upload(upload, dest: Path, limit: int) -> int:
    written = 0
    with open(dest, "wb") as f:
        while chunk := await upload.read(1 << 20):
            written += len(chunk)
            if written > limit:
                raise ApiError(413, f"{upload.filename}: larger than {limit} bytes", code="too_large")
            f.write(chunk)
    return written


def _extract_tar(path: Path, dest: Path, limit: int) -> None:
    """Copy the adapter files out of an uploaded tar by an explicit allowlist (any folder prefix is
    ignored; links, devices and unknown names are skipped; pickles are refused)."""
    try:
        with tarfile.open(path, "r:*") as tar:
            found: set[str] = set()
            for member in tar:
                name = member.name.replace("\\", "/").rsplit("/", 1)[-1]
                if not member.isfile():
                    continue
                _refuse_pickle(name)
                if name not in ACCEPTED:
                    continue
                if name in found:
                    raise ApiError(422, f"the tar holds {name} twice", code="invalid_adapter")
                if member.size > limit:
                    raise ApiError(413, f"{name}: larger than {limit} bytes", code="too_large")
                found.add(name)
                src = tar.extractfile(member)
                if src is None:
                    continue
                with src, open(dest / name, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ApiError(422, f"archive: not a readable tar file ({e})", code="invalid_archive") from None


class AdapterController(Controller):
    path = "/internal/adapters"
    guards = [admin_guard]
    dependencies = {"ctx": Provide(get_ctx, sync_to_thread=False)}
    tags = ["adapters"]

    # -- register ---------------------------------------------------------------------------

    @post("/", status_code=201, responses=errors(409, 422),
          summary="Register the metadata of a signed archive already in the registry's object store")
    async def register(self, ctx: RegistryContext, request: Request, data: AdapterRegister) -> Response[AdapterOut]:
        from archives.digest import file_sha256
        from archives.errors import ArchiveError, ObjectNotFoundError
        from archives.verify import verify_archive

        s = ctx.settings
        if data.rank > s.rank_limit:
            raise ApiError(422, f"rank {data.rank} is above the fleet limit {s.rank_limit}", code="rank_limit", param="rank")
        key = _store_key(ctx, data.weights_uri)
        async with ctx.db.read() as session:
            if await session.get(Tenant, data.tenant_id) is None:
                raise ApiError(422, f"no tenant {data.tenant_id!r}", code="tenant_not_found", param="tenant_id")
            known = await ctx.known_base_hashes(session)
            if data.base_model_hash not in known:
                raise ApiError(422, f"base_model_hash {data.base_model_hash} is not served by this fleet "
                               f"(served: {', '.join(sorted(known)) or 'none'})", code="unknown_base", param="base_model_hash")
            existing = await session.get(Adapter, data.adapter_id)
        if existing is not None and existing.checksum == data.checksum and existing.tenant_id == data.tenant_id:
            return Response(AdapterOut(**adapter_out(existing)), status_code=200)
        if existing is not None:
            raise ApiError(409, f"adapter {data.adapter_id} is already registered with other content",
                           code="adapter_exists", param="adapter_id")

        with tempfile.TemporaryDirectory(prefix="lorafarm-register-") as tmp:
            local = Path(tmp) / "adapter.lar"
            try:
                await ctx.store.get_file(key, local)
            except ObjectNotFoundError:
                raise ApiError(422, f"no object at {data.weights_uri}", code="object_not_found", param="weights_uri") from None
            actual = await asyncio.to_thread(file_sha256, local)
            if actual != data.checksum:
                raise ApiError(422, f"checksum mismatch: the object at {data.weights_uri} has {actual}, "
                               f"not {data.checksum}", code="checksum_mismatch", param="checksum")
            size = local.stat().st_size
            try:
                manifest = await asyncio.to_thread(
                    verify_archive, local, ctx.trusted_keys, base_model_hash=data.base_model_hash, max_rank=s.rank_limit
                )
            except ArchiveError as e:
                raise ApiError(422, f"the object at {data.weights_uri} is not a valid archive: {e}",
                               code="invalid_archive", param="weights_uri") from None
        mismatch = [
            name for name, got, want in (
                ("adapter_id", manifest.adapter_id, data.adapter_id),
                ("tenant_id", manifest.tenant_id, data.tenant_id),
                ("version", manifest.version, data.version),
                ("rank", manifest.rank, data.rank),
                ("target_modules", sorted(manifest.target_modules), sorted(set(data.target_modules))),
            ) if got != want
        ]
        if abs(float(manifest.alpha) - data.alpha) > 1e-9:
            mismatch.append("alpha")
        if mismatch:
            raise ApiError(422, f"the archive's signed manifest disagrees on {', '.join(mismatch)}",
                           code="manifest_mismatch", param=mismatch[0])
        row = Adapter(
            adapter_id=data.adapter_id, tenant_id=data.tenant_id, version=data.version,
            base_model_hash=data.base_model_hash, rank=data.rank, alpha=data.alpha,
            target_modules=sorted(set(data.target_modules)), size_bytes=size, weights_uri=data.weights_uri,
            checksum=data.checksum, status="active", owners_k=s.owners_k,
        )
        async with ctx.db.write() as session:
            again = await session.get(Adapter, data.adapter_id)
            if again is not None:  # a concurrent register won the race
                if again.checksum != data.checksum:
                    raise ApiError(409, f"adapter {data.adapter_id} is already registered with other content",
                                   code="adapter_exists", param="adapter_id")
                return Response(AdapterOut(**adapter_out(again)), status_code=200)
            session.add(row)
            audit.record(session, request, "adapter.register", "adapter", data.adapter_id, tenant_id=data.tenant_id,
                         version=data.version, base_model_hash=data.base_model_hash, checksum=data.checksum)
            await ctx.db.bump(session)
        return Response(AdapterOut(**adapter_out(row)), status_code=201)

    # -- upload -----------------------------------------------------------------------------

    @post("/upload", status_code=201, responses=errors(404, 409, 413, 422), request_max_body_size=MAX_UPLOAD_BODY,
          summary="Upload a PEFT adapter (files or a tar): build, sign, store and register its archive")
    async def upload(
        self,
        ctx: RegistryContext,
        request: Request,
        data: Annotated[AdapterUploadForm, Body(media_type=RequestEncodingType.MULTI_PART)],
    ) -> Response[AdapterUploaded]:
        from archives.errors import ArchiveError

        s = ctx.settings
        tenant_id = (data.tenant_id or "").strip()
        if not _TENANT_RE.fullmatch(tenant_id):
            raise ApiError(400, f"tenant_id {tenant_id!r} is not a tenant id", code="validation_error", param="tenant_id")
        alias = (data.alias or "").strip() or None
        if alias:
            check_alias_name(alias, tenant_id)
        version: int | None = None
        if data.version not in (None, ""):
            try:
                version = int(str(data.version).strip().removeprefix("v"))
                if not 1 <= version < 2**31:
                    raise ValueError
            except ValueError:
                raise ApiError(400, f"version {data.version!r} is not a positive integer", code="validation_error",
                               param="version") from None
        tags = _parse_tags(data.tags)
        uploads = [u for u in (data.files or []) if u is not None and not isinstance(u, str)]
        if data.archive is not None and isinstance(data.archive, str):
            raise ApiError(400, "archive must be a file", code="validation_error", param="archive")
        if bool(uploads) == (data.archive is not None):
            raise ApiError(400, "send either the adapter files (files) or one tar (archive)", code="validation_error",
                           param="files")

        async with ctx.db.read() as session:
            if await session.get(Tenant, tenant_id) is None:
                raise ApiError(422, f"no tenant {tenant_id!r}", code="tenant_not_found", param="tenant_id")

        with tempfile.TemporaryDirectory(prefix="lorafarm-upload-") as tmp:
            folder = Path(tmp) / "adapter"
            folder.mkdir()
            if uploads:
                seen: set[str] = set()
                for u in uploads:
                    name = (u.filename or "").replace("\\", "/").rsplit("/", 1)[-1]
                    _refuse_pickle(name)
                    if name not in ACCEPTED:
                        continue  # README.md, training state, ...: not part of an adapter
                    if name in seen:
                        raise ApiError(400, f"{name} sent twice", code="validation_error", param="files")
                    seen.add(name)
                    await _save_upload(u, folder / name, s.max_upload_bytes if name in PAYLOAD else 1024)
            else:
                tar_path = Path(tmp) / "upload.tar"
                await _save_upload(data.archive, tar_path, s.max_upload_bytes)
                await asyncio.to_thread(_extract_tar, tar_path, folder, s.max_upload_bytes)
            trained = await _trained_base(folder, data.base_model_hash)
            async with ctx.db.read() as session:
                if trained and not (data.base_model or "").strip():
                    known = await ctx.known_base_hashes(session)
                    if trained not in known:
                        raise ApiError(422, f"this adapter was trained on base {trained}, which this fleet does not "
                                       f"serve (served: {', '.join(sorted(known)) or 'none'})", code="base_mismatch",
                                       param="base_model_hash")
                base_hash, base_config = await _choose_base(ctx, session, data.base_model or trained or None)
            _check_trained_base(base_hash, trained, data.assume_base)
            from archives.peft_dir import read_peft_dir

            try:
                info = await asyncio.to_thread(read_peft_dir, folder, base_config)
            except ArchiveError as e:
                raise ApiError(422, f"invalid adapter: {e}", code="invalid_adapter") from None
            if info.rank > s.rank_limit:
                raise ApiError(422, f"rank {info.rank} is above the fleet limit {s.rank_limit}", code="rank_limit")
            response = await _store_and_register(ctx, request, folder, tenant_id, info, base_hash, base_config,
                                                 version, alias, assumed=not trained, tags=tags)
        if alias:
            await ctx.wait_for_routers()  # read-your-writes: routers serve the alias when this returns
        return response

    # -- lifecycle --------------------------------------------------------------------------

    @post("/{adapter_id:str}/disable", status_code=200, responses=errors(404),
          summary="Disable: the router answers 404 for it (aliases kept); replicas unload it once idle")
    async def disable(self, ctx: RegistryContext, request: Request, adapter_id: str = AdapterId) -> AdapterOut:
        return await _set_status(ctx, request, adapter_id, "disabled")

    @post("/{adapter_id:str}/enable", status_code=200, responses=errors(404), summary="Serve a disabled adapter again")
    async def enable(self, ctx: RegistryContext, request: Request, adapter_id: str = AdapterId) -> AdapterOut:
        return await _set_status(ctx, request, adapter_id, "active")

    @delete("/{adapter_id:str}", status_code=204, responses=errors(404, 409),
            summary="Delete an adapter no alias points to (row, placements, stats and its archive)")
    async def delete_adapter(self, ctx: RegistryContext, request: Request, adapter_id: str = AdapterId) -> None:
        async with ctx.db.write() as session:
            row = await session.get(Adapter, adapter_id)
            if row is None:
                raise ApiError(404, f"no adapter {adapter_id}", code="adapter_not_found", param="adapter_id")
            users = (await session.execute(
                select(Alias).where(or_(Alias.adapter_id == adapter_id, Alias.previous_adapter_id == adapter_id,
                                        Alias.tenant_id == row.tenant_id))
                .order_by(Alias.alias)
            )).scalars().all()
            users = [a for a in users if adapter_id in (a.adapter_id, a.previous_adapter_id) or adapter_id in split_ids(a)]
            if users:
                uses = "; ".join(
                    f"alias {a.alias} points to it" if a.adapter_id == adapter_id
                    else f"alias {a.alias} splits traffic to it" if adapter_id in split_ids(a)
                    else f"alias {a.alias} rolls back to it"
                    for a in users
                )
                raise ApiError(409, f"adapter {adapter_id} is in use: {uses}. Point the alias elsewhere "
                               "(`lorafarm aliases set`) or delete it (`lorafarm aliases delete`) first",
                               code="adapter_in_use", param="adapter_id")
            key = ctx.store.key_for(row.weights_uri)
            await session.execute(sql_delete(Placement).where(Placement.adapter_id == adapter_id))
            await session.execute(sql_delete(AdapterStat).where(AdapterStat.adapter_id == adapter_id))
            await session.delete(row)
            audit.record(session, request, "adapter.delete", "adapter", adapter_id, tenant_id=row.tenant_id,
                         version=row.version, checksum=row.checksum)
            await ctx.db.bump(session)
        await ctx.wait_for_routers()  # routers stop resolving it when this returns
        if key:
            try:
                await ctx.store.delete(key)
            except Exception:  # the row is gone; a leftover object is harmless, and logged
                log.exception("could not delete the archive %s of deleted adapter %s", key, adapter_id)

    # -- read -------------------------------------------------------------------------------

    @get("/", responses=errors(), summary="List adapters (optionally of one tenant)")
    async def list_adapters(
        self, ctx: RegistryContext, request: Request,
        tenant_id: str | None = Parameter(query="tenant_id", default=None, max_length=63),
    ) -> list[AdapterOut]:
        reject_unknown_query(request, "tenant_id")
        async with ctx.db.read() as session:
            q = select(Adapter).order_by(Adapter.created_at, Adapter.adapter_id)
            if tenant_id:
                q = q.where(Adapter.tenant_id == tenant_id)
            rows = (await session.execute(q)).scalars().all()
        return [AdapterOut(**adapter_out(r)) for r in rows]

    @get("/{adapter_id:str}", responses=errors(404), summary="One adapter")
    async def get_adapter(self, ctx: RegistryContext, adapter_id: str = AdapterId) -> AdapterOut:
        async with ctx.db.read() as session:
            row = await session.get(Adapter, adapter_id)
        if row is None:
            raise ApiError(404, f"no adapter {adapter_id}", code="adapter_not_found", param="adapter_id")
        return AdapterOut(**adapter_out(row))

    @get("/{adapter_id:str}/archive", responses=errors(404), media_type="application/x-tar",
         summary="The adapter's signed .lar archive (replicas verify it before use)")
    async def archive(self, ctx: RegistryContext, adapter_id: str = AdapterId) -> Stream:
        from archives.errors import ObjectNotFoundError

        async with ctx.db.read() as session:
            row = await session.get(Adapter, adapter_id)
        if row is None:
            raise ApiError(404, f"no adapter {adapter_id}", code="adapter_not_found", param="adapter_id")
        key = ctx.store.key_for(row.weights_uri)
        if key is None:
            raise ApiError(404, f"the archive of {adapter_id} is outside the registry's store", code="object_not_found")
        tmp = Path(tempfile.mkdtemp(prefix="lorafarm-download-"))
        local = tmp / f"{adapter_id}.lar"
        try:
            await ctx.store.get_file(key, local)
        except ObjectNotFoundError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ApiError(404, f"the archive of {adapter_id} is missing from the store", code="object_not_found") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

        async def body():
            try:
                with open(local, "rb") as f:
                    while chunk := await asyncio.to_thread(f.read, 1 << 20):
                        yield chunk
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        return Stream(
            body(),
            media_type="application/x-tar",
            headers={
                "Content-Length": str(local.stat().st_size),
                "Content-Disposition": f'attachment; filename="{adapter_id}.lar"',
                "x-checksum": row.checksum,
            },
        )


async def _set_status(ctx: RegistryContext, request: Request, adapter_id: str, status: str) -> AdapterOut:
    async with ctx.db.write() as session:
        row = await session.get(Adapter, adapter_id)
        if row is None:
            raise ApiError(404, f"no adapter {adapter_id}", code="adapter_not_found", param="adapter_id")
        if row.status != status:
            audit.record(session, request, "adapter.disable" if status == "disabled" else "adapter.enable", "adapter",
                         adapter_id, tenant_id=row.tenant_id, before=row.status)
            row.status = status
            await ctx.db.bump(session)
        out = AdapterOut(**adapter_out(row))
    await ctx.wait_for_routers()  # read-your-writes: routers answer by the new status when this returns
    return out


def _store_key(ctx: RegistryContext, uri: str) -> str:
    """The store key of `uri`, refusing anything outside the registry's own store."""
    try:
        key = ctx.store.key_for(uri)
    except Exception:
        key = None
    if not key:
        raise ApiError(422, f"weights_uri {uri!r} is outside the registry's object store "
                       f"({ctx.settings.store_url}); only archives in it can be registered",
                       code="uri_outside_store", param="weights_uri")
    return key


async def _trained_base(folder: Path, field: str | None) -> str | None:
    """The base hash the upload says the adapter was trained on: the form field and/or the
    base_model_hash.txt sent beside the adapter files (they must agree)."""
    from archives.basehash import is_base_hash, read_trained_base
    from archives.errors import ArchiveError

    field = (field or "").strip() or None
    if field and not is_base_hash(field):
        raise ApiError(400, f"base_model_hash {field[:80]!r} is not sha256:<64 hex>", code="validation_error",
                       param="base_model_hash")
    try:
        recorded = read_trained_base(folder)
    except ArchiveError:
        raise ApiError(400, f"{TRAINED_BASE_FILE} does not hold sha256:<64 hex>", code="validation_error",
                       param="files") from None
    if field and recorded and field != recorded:
        raise ApiError(422, f"base_model_hash {field} disagrees with the {TRAINED_BASE_FILE} sent ({recorded})",
                       code="base_mismatch", param="base_model_hash")
    return field or recorded


def _check_trained_base(served: str, trained: str | None, assume_base: str | None) -> None:
    """An adapter serves correctly only on the exact base it was trained on: a same-shape other base
    loads without error and answers garbage. So an upload must say which base it was trained on
    (`base_model_hash`), or explicitly waive the check (`assume_base=true`)."""
    trained = (trained or "").strip()
    if trained:
        if trained != served:
            raise ApiError(422, f"this adapter was trained on base {trained}, not on the chosen base {served}; "
                           "upload it to a registry serving that base", code="base_mismatch", param="base_model_hash")
        return
    if (assume_base or "").strip().lower() not in ("1", "true", "yes"):
        raise ApiError(422, "base_model_hash is required: send the hash of the base the adapter was trained on "
                       "(`lorafarm archive basehash BASE_DIR` prints it), or assume_base=true to skip the check",
                       code="base_model_hash_required", param="base_model_hash")


async def _choose_base(ctx: RegistryContext, session, base_model: str | None) -> tuple[str, dict | None]:
    """(base hash, base config.json or None) for an upload: a served base's name or hash; by
    default the only base the registry serves."""
    known = await ctx.known_base_hashes(session)
    wanted = (base_model or "").strip()
    if wanted:
        if wanted in ctx.base_models:
            b = ctx.base_models[wanted]
            return b.hash, b.config
        if wanted in known:
            b = ctx.base_by_hash(wanted)
            return wanted, b.config if b else None
        for h, name in known.items():  # a model name a replica reported
            if name == wanted:
                return h, None
        raise ApiError(422, f"base_model {wanted!r} is not served here (served: "
                       f"{', '.join(sorted(ctx.base_models) or sorted(known)) or 'none'})",
                       code="unknown_base", param="base_model")
    if len(ctx.base_models) == 1:
        b = next(iter(ctx.base_models.values()))
        return b.hash, b.config
    if not ctx.base_models and len(known) == 1:
        return next(iter(known)), None
    raise ApiError(422, "base_model is required: this registry serves "
                   f"{len(known)} base models ({', '.join(sorted(ctx.base_models)) or 'none configured'})",
                   code="base_model_required", param="base_model")


MAX_TAGS = 64
MAX_TAGS_BYTES = 8192


def _parse_tags(raw: str | None) -> dict | None:
    """The upload's `tags` field: a JSON object of at most 64 scalars (string keys up to 64
    characters; values strings up to 256 characters, finite numbers, booleans or null), 8 KiB in all."""
    import json
    import math

    if raw is None or not str(raw).strip():
        return None

    def bad(why: str) -> ApiError:
        return ApiError(400, f"tags: {why}", code="validation_error", param="tags")

    if len(raw.encode("utf-8", "surrogatepass")) > MAX_TAGS_BYTES:
        raise bad(f"larger than {MAX_TAGS_BYTES} bytes")
    try:
        tags = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("not valid JSON") from None
    if not isinstance(tags, dict):
        raise bad("must be a JSON object")
    if len(tags) > MAX_TAGS:
        raise bad(f"at most {MAX_TAGS} entries")
    for k, v in tags.items():
        if not k or len(k) > 64 or not k.isprintable():
            raise bad(f"key {k[:64]!r}: 1 to 64 printable characters")
        if isinstance(v, str):
            if len(v) > 256 or "\x00" in v:
                raise bad(f"{k}: a string value has at most 256 characters and no NUL")
        elif isinstance(v, float) and not math.isfinite(v):
            raise bad(f"{k}: numbers must be finite")
        elif v is not None and not isinstance(v, (bool, int, float)):
            raise bad(f"{k}: values are strings, numbers, booleans or null")
        if isinstance(v, str) and lone_surrogate(v):
            raise bad(f"{k}: not valid Unicode")
    return tags


def lone_surrogate(text: str) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in text)


async def _store_and_register(ctx, request, folder, tenant_id, info, base_hash, base_config, version, alias,
                              *, assumed: bool = False, tags: dict | None = None) -> Response:
    """Build, sign and store the archive, then insert the row (and alias) in one transaction; on any
    failure after the object was written, delete it. Idempotent on (tenant, content)."""
    from archives.build import build_archive
    from archives.digest import file_sha256
    from archives.errors import ArchiveError
    from archives.ids import adapter_id_for

    s = ctx.settings
    adapter_id = adapter_id_for(tenant_id, info.content_checksum)
    async with ctx.upload_lock:
        async with ctx.db.read() as session:
            existing = await session.get(Adapter, adapter_id)
            if version is None and existing is None:
                top = (await session.execute(select(func.max(Adapter.version)).where(Adapter.tenant_id == tenant_id))
                       ).scalar()
                version = int(top or 0) + 1
        if existing is not None:
            if existing.base_model_hash != base_hash:
                raise ApiError(409, f"these files are already registered as {adapter_id} for base "
                               f"{existing.base_model_hash}", code="adapter_exists")
            alias_row = None
            if alias:
                async with ctx.db.write() as session:
                    before = await session.get(Alias, alias)
                    changed = before is None or before.adapter_id != adapter_id or before.split is not None
                    alias_row = await apply_alias(ctx, session, alias, adapter_id)
                    if changed:
                        audit.record(session, request, "alias.set", "alias", alias, adapter_id=adapter_id,
                                     previous_adapter_id=before.adapter_id if before else None)
                        await ctx.db.bump(session)
            out = AdapterUploaded(**adapter_out(existing), alias=alias_row.alias if alias_row else None, created=False)
            return Response(out, status_code=200)

        with tempfile.TemporaryDirectory(prefix="lorafarm-build-") as tmp:
            lar = Path(tmp) / f"{adapter_id}.lar"
            try:
                await asyncio.to_thread(
                    build_archive, folder, lar, private_key=ctx.private_key, tenant_id=tenant_id,
                    adapter_id=adapter_id, version=version, base_model_hash=base_hash, base_config=base_config,
                )
            except ArchiveError as e:
                raise ApiError(422, f"invalid adapter: {e}", code="invalid_adapter") from None
            checksum = await asyncio.to_thread(file_sha256, lar)
            size = lar.stat().st_size
            key = f"adapters/{tenant_id}/{adapter_id}.lar"
            await ctx.store.put_file(key, lar)
        row = Adapter(
            adapter_id=adapter_id, tenant_id=tenant_id, version=version, base_model_hash=base_hash,
            rank=info.rank, alpha=float(info.alpha), target_modules=sorted(set(info.target_modules)),
            size_bytes=size, weights_uri=ctx.store.uri_for(key), checksum=checksum,
            content_checksum=info.content_checksum, status="active", owners_k=s.owners_k, created_at=utcnow(),
            tags=tags,
        )
        try:
            async with ctx.db.write() as session:
                session.add(row)
                await session.flush()
                audit.record(session, request, "adapter.upload", "adapter", adapter_id, tenant_id=tenant_id,
                             version=version, base_model_hash=base_hash, base_assumed=assumed or None,
                             checksum=checksum, tags=tags)
                before = await session.get(Alias, alias) if alias else None
                previous = before.adapter_id if before else None
                alias_row = await apply_alias(ctx, session, alias, adapter_id) if alias else None
                if alias_row is not None:
                    audit.record(session, request, "alias.set", "alias", alias, adapter_id=adapter_id,
                                 previous_adapter_id=previous)
                await ctx.db.bump(session)
        except BaseException:
            await asyncio.shield(_delete_orphan(ctx, key, adapter_id))
            raise
    out = AdapterUploaded(**adapter_out(row), alias=alias_row.alias if alias_row else None, created=True)
    return Response(out, status_code=201)


async def _delete_orphan(ctx: RegistryContext, key: str, adapter_id: str) -> None:
    """Remove the object of a failed upload, unless another registry process registered the same
    content (same key) meanwhile. Best effort: an orphan is harmless, and logged."""
    try:
        async with ctx.db.read() as session:
            if await session.get(Adapter, adapter_id) is not None:
                return
    except Exception:
        pass  # the database is what failed: the row cannot be there from us
    try:
        await ctx.store.delete(key)
    except Exception:
        log.exception("could not delete the object %s of a failed upload", key)
