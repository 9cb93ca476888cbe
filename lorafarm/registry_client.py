"""The one async client of the registry's `/internal/*` HTTP API (docs/contracts.md).

Every service (router, replica, `lorafarm up`) and the admin CLI use it:

    async with RegistryClient("http://127.0.0.1:8100", admin_token) as reg:
        tenant = await reg.create_tenant("acme")           # {"tenant_id", "api_key", "key_id"}
        adapter = await reg.upload_adapter(peft_dir, "acme", alias="acme/support:prod")
        table, etag = await reg.routing_table()            # (None, etag) when unchanged

Answers are the JSON objects of the contract (plain dicts and lists). Any non-2xx answer, and any
transport failure, raises `RegistryError(status, message)`; status 0 means no HTTP answer at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

DEFAULT_REGISTRY_URL = "http://127.0.0.1:8100"


class RegistryError(Exception):
    """A failed registry call: `status` is the HTTP status (0: no answer), `message` the reason."""

    def __init__(self, status: int, message: str):
        super().__init__(f"registry answered {status}: {message}" if status else message)
        self.status = status
        self.message = message


def _alias_path(alias: str) -> str:
    # `acme/support:prod` -> `acme/support:prod`: the slash between tenant and name is a path
    # separator on the server (routes /internal/aliases/{tenant_id}/{name}); other characters quoted.
    return "/".join(quote(part, safe=":") for part in alias.split("/", 1))


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:500]


def _error_code(response: httpx.Response) -> str | None:
    try:
        err = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("code") if isinstance(err, dict) else None


def _actor() -> str:
    """$LORAFARM_ACTOR, else user@host (the admin token is shared: the audit trail needs a name)."""
    import getpass
    import socket

    if os.environ.get("LORAFARM_ACTOR"):
        return os.environ["LORAFARM_ACTOR"][:255]
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:255]


class RegistryClient:
    """Async client of the registry. `url` defaults to $LORAFARM_REGISTRY_URL, `token` (the admin
    bearer token) to $LORAFARM_ADMIN_TOKEN. Use it as an async context manager or call `aclose()`."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.url = (url or os.environ.get("LORAFARM_REGISTRY_URL") or DEFAULT_REGISTRY_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("LORAFARM_ADMIN_TOKEN")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        headers["x-lorafarm-actor"] = _actor()  # who, for the registry's audit trail
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing ---------------------------------------------------------------------------

    async def _request(self, method: str, path: str, *, ok: Iterable[int] = (), **kw) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise RegistryError(0, f"registry at {self.url} unreachable: {e.__class__.__name__}: {e}") from e
        if response.is_success or response.status_code in ok:
            return response
        raise RegistryError(response.status_code, _error_message(response))

    async def _json(self, method: str, path: str, **kw) -> Any:
        response = await self._request(method, path, **kw)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    # -- health -----------------------------------------------------------------------------

    async def health(self) -> dict:
        return await self._json("GET", "/health")

    # -- tenants and API keys ---------------------------------------------------------------

    async def create_tenant(
        self, name: str, requests_per_s: float | None = None, tokens_per_s: float | None = None
    ) -> dict:
        """-> {tenant_id, api_key, key_id}; the key is shown only in this answer."""
        body: dict[str, Any] = {"name": name}
        if requests_per_s is not None:
            body["requests_per_s"] = requests_per_s
        if tokens_per_s is not None:
            body["tokens_per_s"] = tokens_per_s
        return await self._json("POST", "/internal/tenants", json=body)

    async def list_tenants(self) -> list[dict]:
        return await self._json("GET", "/internal/tenants")

    async def create_key(self, tenant_id: str) -> dict:
        """-> {key_id, api_key} (shown once)."""
        return await self._json("POST", f"/internal/tenants/{quote(tenant_id, safe='')}/keys")

    async def list_keys(self, tenant_id: str) -> list[dict]:
        return await self._json("GET", f"/internal/tenants/{quote(tenant_id, safe='')}/keys")

    async def revoke_key(self, tenant_id: str, key_id: str) -> None:
        await self._json(
            "DELETE", f"/internal/tenants/{quote(tenant_id, safe='')}/keys/{quote(key_id, safe='')}"
        )

    async def set_tenant_limits(self, tenant_id: str, **limits: float | None) -> dict:
        """Change `requests_per_s` and/or `tokens_per_s` (None: unlimited) -> tenant."""
        return await self._json("PATCH", f"/internal/tenants/{quote(tenant_id, safe='')}", json=limits)

    async def rotate_keys(self, tenant_id: str, key_id: str | None = None) -> dict:
        """A new key; revokes `key_id` (or every live key of the tenant) -> {key_id, api_key, revoked_key_ids}."""
        params = {"key_id": key_id} if key_id else None
        return await self._json("POST", f"/internal/tenants/{quote(tenant_id, safe='')}/keys/rotate", params=params)

    async def verify_api_key(self, api_key: str) -> dict | None:
        """-> {tenant_id, key_id, requests_per_s, tokens_per_s}, or None for an unknown/revoked key."""
        response = await self._request("POST", "/internal/auth/verify", json={"api_key": api_key}, ok=(401,))
        if response.status_code == 401:
            # 401 is also the answer to a wrong *admin* token: tell the two apart by error code.
            if _error_code(response) != "invalid_api_key":
                raise RegistryError(401, _error_message(response))
            return None
        return response.json()

    # -- adapters ---------------------------------------------------------------------------

    async def register_adapter(self, adapter: Mapping[str, Any]) -> dict:
        """Register an archive already in the store: {adapter_id, tenant_id, version, base_model_hash,
        rank, alpha, target_modules, weights_uri, checksum} -> adapter."""
        return await self._json("POST", "/internal/adapters", json=dict(adapter))

    async def upload_adapter(
        self,
        peft_dir: str | os.PathLike,
        tenant_id: str,
        alias: str | None = None,
        base_model: str | None = None,
        *,
        version: str | None = None,
        base_model_hash: str | None = None,
        assume_base: bool = False,
    ) -> dict:
        """Upload a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) or a tar
        file of one. The registry builds, signs, stores and registers the archive. Idempotent: the
        same files for the same tenant return the same adapter. -> adapter (+ "alias").

        `base_model_hash`: the base the adapter was trained on (`archives.basehash.base_model_hash`);
        default: the `base_model_hash.txt` beside the adapter. Without either the registry refuses
        the upload (422 base_model_hash_required) unless `assume_base=True`."""
        from archives.basehash import read_trained_base
        from archives.errors import ArchiveError

        path = Path(peft_dir)
        data: dict[str, str] = {"tenant_id": tenant_id}
        if base_model_hash is None and path.is_dir():
            try:
                base_model_hash = read_trained_base(path)
            except ArchiveError as e:
                raise RegistryError(0, str(e)) from None
        if base_model_hash:
            data["base_model_hash"] = base_model_hash
        if assume_base:
            data["assume_base"] = "true"
        if alias:
            data["alias"] = alias
        if base_model:
            data["base_model"] = base_model
        if version:
            data["version"] = version
        handles = []
        try:
            if path.is_dir():
                files = []
                for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
                    if (path / name).is_file():
                        fh = open(path / name, "rb")
                        handles.append(fh)
                        files.append(("files", (name, fh, "application/octet-stream")))
                if not files:
                    raise RegistryError(0, f"{path} holds no adapter_config.json / adapter weights")
            else:
                fh = open(path, "rb")
                handles.append(fh)
                files = [("archive", (path.name, fh, "application/x-tar"))]
            return await self._json("POST", "/internal/adapters/upload", data=data, files=files)
        finally:
            for fh in handles:
                fh.close()

    async def get_adapter(self, adapter_id: str) -> dict:
        return await self._json("GET", f"/internal/adapters/{quote(adapter_id, safe='')}")

    async def list_adapters(self, tenant_id: str | None = None) -> list[dict]:
        params = {"tenant_id": tenant_id} if tenant_id else None
        return await self._json("GET", "/internal/adapters", params=params)

    async def disable_adapter(self, adapter_id: str) -> dict:
        return await self._json("POST", f"/internal/adapters/{quote(adapter_id, safe='')}/disable")

    async def enable_adapter(self, adapter_id: str) -> dict:
        return await self._json("POST", f"/internal/adapters/{quote(adapter_id, safe='')}/enable")

    async def delete_adapter(self, adapter_id: str) -> None:
        """Refused (409) while an alias points to it or would roll back to it."""
        await self._json("DELETE", f"/internal/adapters/{quote(adapter_id, safe='')}")

    async def download_archive(self, adapter_id: str, dest_path: str | os.PathLike) -> Path:
        """Stream the signed `.lar` of `adapter_id` to `dest_path` (written to a temp name, then
        renamed, so a half download never looks complete). Verify it before use."""
        dest = Path(dest_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        try:
            async with self._http.stream("GET", f"/internal/adapters/{quote(adapter_id, safe='')}/archive") as r:
                if not r.is_success:
                    await r.aread()
                    raise RegistryError(r.status_code, _error_message(r))
                with open(tmp, "wb") as f:
                    async for chunk in r.aiter_bytes(1 << 20):
                        f.write(chunk)
            os.replace(tmp, dest)
        except httpx.HTTPError as e:
            raise RegistryError(0, f"archive download from {self.url} failed: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    # -- aliases ----------------------------------------------------------------------------

    async def set_alias(self, alias: str, adapter_id: str) -> dict:
        """Deploy: point `alias` at `adapter_id` -> {alias, tenant_id, adapter_id, previous_adapter_id, updated_at}."""
        return await self._json("PUT", f"/internal/aliases/{_alias_path(alias)}", json={"adapter_id": adapter_id})

    async def rollback_alias(self, alias: str) -> dict:
        """Swap the alias back to its previous adapter (a second rollback re-deploys)."""
        return await self._json("POST", f"/internal/aliases/{_alias_path(alias)}/rollback")

    async def delete_alias(self, alias: str) -> None:
        await self._json("DELETE", f"/internal/aliases/{_alias_path(alias)}")

    async def get_alias(self, alias: str) -> dict:
        return await self._json("GET", f"/internal/aliases/{_alias_path(alias)}")

    async def list_aliases(self, tenant_id: str | None = None) -> list[dict]:
        params = {"tenant_id": tenant_id} if tenant_id else None
        return await self._json("GET", "/internal/aliases", params=params)

    async def audit(self, target: str | None = None, *, action: str | None = None, limit: int = 100) -> list[dict]:
        """The audit trail, newest first: [{id, at, actor, client, action, target_kind, target, detail}]."""
        params = {k: v for k, v in {"target": target, "action": action, "limit": limit}.items() if v is not None}
        return await self._json("GET", "/internal/audit", params=params)

    # -- replicas and placements ------------------------------------------------------------

    async def join_replica(
        self,
        replica_id: str,
        url: str,
        base_model_hash: str,
        models: list[str],
        capacity_weight: float = 1.0,
    ) -> dict:
        body = {
            "replica_id": replica_id,
            "url": url,
            "base_model_hash": base_model_hash,
            "models": list(models),
            "capacity_weight": capacity_weight,
        }
        return await self._json("POST", "/internal/replicas/join", json=body)

    async def heartbeat(self, replica_id: str, state: Any = None) -> dict:
        """`state`: a `lorafarm.schemas.ReplicaState` (or its dict), optional."""
        if state is not None and hasattr(state, "model_dump"):
            state = state.model_dump(mode="json")
        kw = {"json": state} if state is not None else {}
        return await self._json("POST", f"/internal/replicas/{quote(replica_id, safe='')}/heartbeat", **kw)

    async def list_replicas(self) -> list[dict]:
        return await self._json("GET", "/internal/replicas")

    async def placement(self, adapter_id: str) -> dict:
        """-> {adapter_id, k, owners: [replica_id]}"""
        return await self._json("GET", f"/internal/placements/{quote(adapter_id, safe='')}")

    async def placements_for_replica(self, replica_id: str) -> dict:
        """-> {replica_id, adapters: [adapter_id]}: the adapters this replica owns."""
        return await self._json("GET", "/internal/placements", params={"replica_id": replica_id})

    # -- foreign workers and critical models -------------------------------------------------

    async def put_worker(self, name: str, url: str, kind: str, api_key_env: str | None = None,
                         weight: float = 1.0) -> dict:
        body = {"url": url, "kind": kind, "api_key_env": api_key_env, "weight": weight}
        return await self._json("PUT", f"/internal/workers/{quote(name, safe='')}", json=body)

    async def delete_worker(self, name: str) -> None:
        await self._request("DELETE", f"/internal/workers/{quote(name, safe='')}")

    async def list_workers(self) -> list[dict]:
        return await self._json("GET", "/internal/workers")

    async def set_critical(self, model: str, critical: bool = True) -> list[dict]:
        """-> every critical model after the change."""
        return await self._json("POST", "/internal/models/critical", json={"model": model, "critical": critical})

    async def list_critical(self) -> list[dict]:
        return await self._json("GET", "/internal/models/critical")

    # -- stats and routing ------------------------------------------------------------------

    async def push_stats(self, window_s: float, adapters: Iterable[Mapping[str, Any]]) -> None:
        """adapters: [{adapter_id, requests, tokens, gpu_hits}] counted over the last `window_s` seconds."""
        body = {"window_s": window_s, "adapters": [dict(a) for a in adapters]}
        await self._json("POST", "/internal/stats", json=body)

    async def routing_table(
        self, etag: str | None = None, *, wait: float = 0.0, router_id: str | None = None
    ) -> tuple[dict | None, str | None]:
        """-> (table, etag), or (None, etag) when the table still matches `etag` (304).
        `wait` > 0 long-polls: the registry holds the 304 up to that many seconds until the table
        changes. `router_id` names the caller, so the registry can wait for it to apply a deploy."""
        headers = {"If-None-Match": etag} if etag else {}
        if router_id:
            headers["X-Lorafarm-Router"] = router_id
        kw: dict = {}
        if wait > 0:
            kw = {"params": {"wait": f"{wait:g}"}, "timeout": self._http.timeout.read + wait if self._http.timeout.read
                  else None}
        response = await self._request("GET", "/internal/routing", headers=headers, ok=(304,), **kw)
        new_etag = response.headers.get("etag", etag)
        if response.status_code == 304:
            return None, new_etag
        return response.json(), new_etag
