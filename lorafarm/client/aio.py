"""`AsyncLorafarmClient`: the async client of the registry's `/internal/*` API (httpx).

    async with AsyncLorafarmClient("http://127.0.0.1:8100", admin_token) as reg:
        tenant = await reg.create_tenant("acme")                  # {"tenant_id", "api_key", "key_id"}
        v8 = await reg.upload_adapter(peft_dir, "acme", tags={"run": "sft-3", "step": 400})
        await reg.split_alias("acme/support:prod", {v7: 90, v8["adapter_id"]: 10})
        rollout = await reg.start_rollout("acme/support:prod", v8["adapter_id"], steps=(10, 50, 100),
                                          interval="5m")
        done = await reg.wait_rollout(rollout["rollout_id"])      # promoted | rolled_back | aborted

Every service of the farm (router, replica, `lorafarm up`) uses it too (it was
`lorafarm.registry_client.RegistryClient`, which is now this class). Answers are the JSON objects of
the contract, typed as the `TypedDict`s of `lorafarm.client.types`. A non-2xx answer, and a
transport failure, raises `LorafarmError` (`lorafarm.client.errors`) with the registry's message.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

from lorafarm.client import _calls as calls
from lorafarm.client._calls import DEFAULT_REGISTRY_URL, Call
from lorafarm.client._common import TERMINAL_ROLLOUT_STATES, alias_versions
from lorafarm.client.errors import error_for
from lorafarm.client.types import (
    Adapter,
    AdapterUploaded,
    Alias,
    AliasMetrics,
    AliasVersion,
    AuditEntry,
    KeyCreated,
    Rollout,
    RolloutBounds,
    Tenant,
    TenantCreated,
)

__all__ = ["AsyncLorafarmClient", "DEFAULT_REGISTRY_URL"]


class AsyncLorafarmClient:
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
        self.url, self.token, headers = calls.connection(url, token)
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    async def __aenter__(self) -> AsyncLorafarmClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing ---------------------------------------------------------------------------

    async def _run(self, call: Call) -> Any:
        files, handles = call.files() if call.files is not None else (None, [])
        try:
            kw = call.request_kwargs()
            if files is not None:
                kw["files"] = files
            try:
                response = await self._http.request(call.method, call.path, **kw)
            except httpx.HTTPError as e:
                raise calls.unreachable(self.url, e) from e
        finally:
            for fh in handles:
                fh.close()
        if not (response.is_success or response.status_code in call.ok):
            raise calls.raise_for(response)
        return call.parse(response)

    # -- health -----------------------------------------------------------------------------

    async def health(self) -> dict:
        return await self._run(Call("GET", "/health"))

    # -- tenants and API keys ---------------------------------------------------------------

    async def create_tenant(self, name: str, requests_per_s: float | None = None,
                            tokens_per_s: float | None = None) -> TenantCreated:
        """-> {tenant_id, api_key, key_id}; the key is shown only in this answer."""
        return await self._run(calls.create_tenant(name, requests_per_s, tokens_per_s))

    async def list_tenants(self) -> list[Tenant]:
        return await self._run(calls.list_tenants())

    async def create_key(self, tenant_id: str) -> KeyCreated:
        """-> {key_id, api_key} (shown once)."""
        return await self._run(calls.create_key(tenant_id))

    async def list_keys(self, tenant_id: str) -> list[dict]:
        return await self._run(calls.list_keys(tenant_id))

    async def revoke_key(self, tenant_id: str, key_id: str) -> None:
        await self._run(calls.revoke_key(tenant_id, key_id))

    async def set_tenant_limits(self, tenant_id: str, **limits: float | None) -> Tenant:
        """Change `requests_per_s`, `tokens_per_s` and/or `weight` (None: unlimited / 1) -> tenant."""
        return await self._run(calls.set_tenant_limits(tenant_id, limits))

    async def rotate_keys(self, tenant_id: str, key_id: str | None = None) -> KeyCreated:
        """A new key; revokes `key_id` (or every live key of the tenant) -> {key_id, api_key, revoked_key_ids}."""
        return await self._run(calls.rotate_keys(tenant_id, key_id))

    async def verify_api_key(self, api_key: str) -> dict | None:
        """-> {tenant_id, key_id, requests_per_s, tokens_per_s}, or None for an unknown/revoked key."""
        return await self._run(calls.verify_api_key(api_key))

    # -- adapters ---------------------------------------------------------------------------

    async def register_adapter(self, adapter: Mapping[str, Any]) -> Adapter:
        """Register an archive already in the store: {adapter_id, tenant_id, version, base_model_hash,
        rank, alpha, target_modules, weights_uri, checksum} -> adapter."""
        return await self._run(calls.register_adapter(adapter))

    async def upload_adapter(
        self,
        peft_dir: str | os.PathLike,
        tenant_id: str,
        alias: str | None = None,
        base_model: str | None = None,
        *,
        version: str | int | None = None,
        base_model_hash: str | None = None,
        assume_base: bool = False,
        tags: Mapping[str, Any] | None = None,
    ) -> AdapterUploaded:
        """Upload a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) or a tar
        file of one. The registry builds, signs, stores and registers the archive. Idempotent: the
        same files for the same tenant return the same adapter. -> adapter (+ "alias", "created").

        `base_model_hash`: the base the adapter was trained on (`archives.basehash.base_model_hash`);
        default: the `base_model_hash.txt` beside the adapter. Without either the registry refuses
        the upload (422 base_model_hash_required) unless `assume_base=True`. `tags`: a flat JSON
        object kept with the version (run name, step, eval metrics...)."""
        return await self._run(calls.upload_adapter(peft_dir, tenant_id, alias, base_model, version=version,
                                                    base_model_hash=base_model_hash, assume_base=assume_base,
                                                    tags=tags))

    async def get_adapter(self, adapter_id: str) -> Adapter:
        return await self._run(calls.get_adapter(adapter_id))

    async def list_adapters(self, tenant_id: str | None = None) -> list[Adapter]:
        return await self._run(calls.list_adapters(tenant_id))

    async def disable_adapter(self, adapter_id: str) -> Adapter:
        return await self._run(calls.adapter_status(adapter_id, "disable"))

    async def enable_adapter(self, adapter_id: str) -> Adapter:
        return await self._run(calls.adapter_status(adapter_id, "enable"))

    async def delete_adapter(self, adapter_id: str) -> None:
        """Refused (409) while an alias points to it, splits traffic to it, or would roll back to it."""
        await self._run(calls.delete_adapter(adapter_id))

    async def download_archive(self, adapter_id: str, dest_path: str | os.PathLike) -> Path:
        """Stream the signed `.lar` of `adapter_id` to `dest_path` (written to a temp name, then
        renamed, so a half download never looks complete). Verify it before use."""
        dest = Path(dest_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        try:
            async with self._http.stream("GET", f"/internal/adapters/{calls.seg(adapter_id)}/archive") as r:
                if not r.is_success:
                    await r.aread()
                    raise calls.raise_for(r)
                with open(tmp, "wb") as f:
                    async for chunk in r.aiter_bytes(1 << 20):
                        f.write(chunk)
            os.replace(tmp, dest)
        except httpx.HTTPError as e:
            raise error_for(0, f"archive download from {self.url} failed: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    # -- aliases ----------------------------------------------------------------------------

    async def set_alias(self, alias: str, adapter_id: str) -> Alias:
        """Deploy: point `alias` at `adapter_id` alone (ends any split or rollout on it) ->
        {alias, tenant_id, adapter_id, previous_adapter_id, split, updated_at}. Routers serve it
        when this returns (read-your-writes)."""
        return await self._run(calls.set_alias(alias, adapter_id))

    async def split_alias(self, alias: str,
                          targets: Mapping[str, float] | Iterable[tuple[str, float]] | Iterable[Mapping[str, Any]]
                          ) -> Alias:
        """Split `alias`'s traffic: {adapter_id: percent} (or pairs), percents summing to 100, e.g.
        {v7: 90, v8: 10}. A request carrying `user` (or x-lorafarm-user) always gets the same version
        for the same split; others are assigned per request. The alias's stable version stays (a
        rollback returns all traffic to it): the current one if it is in the split, else the heaviest."""
        return await self._run(calls.split_alias(alias, targets))

    async def promote_alias(self, alias: str, adapter_id: str | None = None) -> Alias:
        """End a split by sending all traffic to `adapter_id` (default: the split's other version
        than the stable one); the stable version becomes the previous one."""
        return await self._run(calls.promote_alias(alias, adapter_id))

    async def rollback_alias(self, alias: str) -> Alias:
        """A split: all traffic back to the stable version. No split: swap the alias back to its
        previous adapter (a second rollback re-deploys)."""
        return await self._run(calls.rollback_alias(alias))

    async def delete_alias(self, alias: str) -> None:
        await self._run(calls.delete_alias(alias))

    async def get_alias(self, alias: str) -> Alias:
        return await self._run(calls.get_alias(alias))

    async def list_aliases(self, tenant_id: str | None = None) -> list[Alias]:
        return await self._run(calls.list_aliases(tenant_id))

    async def versions(self, alias: str) -> list[AliasVersion]:
        """Every version (adapter) of the alias's tenant, newest first, with its role in the alias
        (stable, canary, previous, other) and its share of the traffic."""
        info = await self.get_alias(alias)
        return alias_versions(info, await self.list_adapters(info["tenant_id"]))

    async def alias_metrics(self, alias: str, *, since: str | None = None, window_s: float | None = None,
                            rollout_step: bool = False) -> AliasMetrics:
        """Per-version traffic of `alias` summed over the routers' pushed windows: since `since`
        (ISO time), over the last `window_s` seconds (default 300), or over the running rollout's
        current step (`rollout_step=True`) -> {alias, since, until, versions: {adapter_id: summary}}."""
        return await self._run(calls.alias_metrics(alias, since=since, window_s=window_s, rollout_step=rollout_step))

    # -- rollouts ---------------------------------------------------------------------------

    async def start_rollout(self, alias: str, adapter_id: str, *, steps: Iterable[int] = (10, 50, 100),
                            interval: str | float = "5m", bounds: RolloutBounds | Mapping[str, Any] | None = None
                            ) -> Rollout:
        """Progressive rollout of `adapter_id` on `alias`, run by the registry: the new version gets
        steps[0] percent of the traffic, then each next step after `interval` (seconds, or "30s",
        "5m") while its error rate and p95 TTFT stay within `bounds` of the current version's; the
        last step (100) promotes it. A breached bound rolls back at once (audited, logged). One
        rollout per alias (409 otherwise)."""
        return await self._run(calls.start_rollout(alias, adapter_id, steps=steps, interval=interval, bounds=bounds))

    async def get_rollout(self, rollout_id: int) -> Rollout:
        return await self._run(calls.get_rollout(rollout_id))

    async def list_rollouts(self, alias: str | None = None, state: str | None = None, limit: int = 100
                            ) -> list[Rollout]:
        """Rollouts, newest first (optionally of one alias, in one state)."""
        return await self._run(calls.list_rollouts(alias, state, limit))

    async def abort_rollout(self, rollout_id: int) -> Rollout:
        """Stop a running rollout: all traffic back to the old version (state aborted)."""
        return await self._run(calls.abort_rollout(rollout_id))

    async def wait_rollout(self, rollout_id: int, timeout: float | None = None, poll_s: float = 1.0) -> Rollout:
        """Poll until the rollout is promoted, rolled back or aborted; TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            r = await self.get_rollout(rollout_id)
            if r["state"] in TERMINAL_ROLLOUT_STATES:
                return r
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"rollout {rollout_id} still {r['state']} at step {r['percent']}% after {timeout} s")
            await asyncio.sleep(poll_s)

    async def audit(self, target: str | None = None, *, action: str | None = None, limit: int = 100
                    ) -> list[AuditEntry]:
        """The audit trail, newest first: [{id, at, actor, client, action, target_kind, target, detail}]."""
        return await self._run(calls.audit(target, action=action, limit=limit))

    # -- replicas and placements ------------------------------------------------------------

    async def join_replica(self, replica_id: str, url: str, base_model_hash: str, models: list[str],
                           capacity_weight: float = 1.0) -> dict:
        return await self._run(calls.join_replica(replica_id, url, base_model_hash, models, capacity_weight))

    async def heartbeat(self, replica_id: str, state: Any = None) -> dict:
        """`state`: a `lorafarm.schemas.ReplicaState` (or its dict), optional."""
        return await self._run(calls.heartbeat(replica_id, state))

    async def list_replicas(self) -> list[dict]:
        return await self._run(calls.list_replicas())

    async def placement(self, adapter_id: str) -> dict:
        """-> {adapter_id, k, owners: [replica_id]}"""
        return await self._run(calls.placement(adapter_id))

    async def placements_for_replica(self, replica_id: str) -> dict:
        """-> {replica_id, adapters: [adapter_id]}: the adapters this replica owns."""
        return await self._run(calls.placements_for_replica(replica_id))

    # -- foreign workers and critical models -------------------------------------------------

    async def put_worker(self, name: str, url: str, kind: str, api_key_env: str | None = None,
                         weight: float = 1.0) -> dict:
        return await self._run(calls.put_worker(name, url, kind, api_key_env, weight))

    async def delete_worker(self, name: str) -> None:
        await self._run(calls.delete_worker(name))

    async def list_workers(self) -> list[dict]:
        return await self._run(calls.list_workers())

    async def set_critical(self, model: str, critical: bool = True) -> list[dict]:
        """-> every critical model after the change."""
        return await self._run(calls.set_critical(model, critical))

    async def list_critical(self) -> list[dict]:
        return await self._run(calls.list_critical())

    # -- stats and routing ------------------------------------------------------------------

    async def push_stats(self, window_s: float, adapters: Iterable[Mapping[str, Any]]) -> None:
        """adapters: [{adapter_id, requests, tokens, gpu_hits}] counted over the last `window_s` seconds."""
        await self._run(calls.push_stats(window_s, adapters))

    async def push_version_stats(self, window_s: float, versions: Iterable[Mapping[str, Any]],
                                 router_id: str | None = None) -> None:
        """versions: [{alias, adapter_id, **VersionCounts.to_wire()}] counted by a router over `window_s` s."""
        await self._run(calls.push_version_stats(window_s, versions, router_id))

    async def routing_table(
        self, etag: str | None = None, *, wait: float = 0.0, router_id: str | None = None
    ) -> tuple[dict | None, str | None]:
        """-> (table, etag), or (None, etag) when the table still matches `etag` (304).
        `wait` > 0 long-polls: the registry holds the 304 up to that many seconds until the table
        changes. `router_id` names the caller, so the registry can wait for it to apply a deploy."""
        return await self._run(calls.routing_table(etag, wait, router_id, self._http.timeout.read))


RegistryClient = AsyncLorafarmClient  # its historical name (lorafarm.registry_client)
