"""`LorafarmClient`: the blocking twin of `AsyncLorafarmClient` for scripts, notebooks, training jobs
(the Trainer callback) and the CLI. Same calls (`lorafarm.client._calls`), same answers, same errors;
the services' own calls (replica join and heartbeat, routing table, stats push) are async only.

    with LorafarmClient("http://127.0.0.1:8100", admin_token) as reg:
        v8 = reg.upload_adapter("out/adapter", "acme", tags={"run": "sft-3"})
        reg.start_rollout("acme/support:prod", v8["adapter_id"], steps=(10, 50, 100), interval="5m")
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from lorafarm.client import _calls as calls
from lorafarm.client._calls import Call
from lorafarm.client._common import TERMINAL_ROLLOUT_STATES, alias_versions
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

__all__ = ["LorafarmClient"]


class LorafarmClient:
    """Blocking client of the registry. `url` defaults to $LORAFARM_REGISTRY_URL, `token` (the
    admin bearer token) to $LORAFARM_ADMIN_TOKEN. Use it as a context manager or call `close()`."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url, self.token, headers = calls.connection(url, token)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> LorafarmClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, call: Call) -> Any:
        files, handles = call.files() if call.files is not None else (None, [])
        try:
            kw = call.request_kwargs()
            if files is not None:
                kw["files"] = files
            try:
                response = self._http.request(call.method, call.path, **kw)
            except httpx.HTTPError as e:
                raise calls.unreachable(self.url, e) from e
        finally:
            for fh in handles:
                fh.close()
        if not (response.is_success or response.status_code in call.ok):
            raise calls.raise_for(response)
        return call.parse(response)

    def health(self) -> dict:
        return self._run(Call("GET", "/health"))

    # -- tenants and API keys (see AsyncLorafarmClient for each call's answer) ----------------

    def create_tenant(self, name: str, requests_per_s: float | None = None,
                      tokens_per_s: float | None = None) -> TenantCreated:
        return self._run(calls.create_tenant(name, requests_per_s, tokens_per_s))

    def list_tenants(self) -> list[Tenant]:
        return self._run(calls.list_tenants())

    def create_key(self, tenant_id: str) -> KeyCreated:
        return self._run(calls.create_key(tenant_id))

    def list_keys(self, tenant_id: str) -> list[dict]:
        return self._run(calls.list_keys(tenant_id))

    def revoke_key(self, tenant_id: str, key_id: str) -> None:
        self._run(calls.revoke_key(tenant_id, key_id))

    def set_tenant_limits(self, tenant_id: str, **limits: float | None) -> Tenant:
        return self._run(calls.set_tenant_limits(tenant_id, limits))

    def rotate_keys(self, tenant_id: str, key_id: str | None = None) -> KeyCreated:
        return self._run(calls.rotate_keys(tenant_id, key_id))

    # -- adapters -----------------------------------------------------------------------------

    def upload_adapter(
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
        """Upload a PEFT folder (or a tar of one): the registry builds, signs and registers the archive."""
        return self._run(calls.upload_adapter(peft_dir, tenant_id, alias, base_model, version=version,
                                              base_model_hash=base_model_hash, assume_base=assume_base, tags=tags))

    def register_adapter(self, adapter: Mapping[str, Any]) -> Adapter:
        return self._run(calls.register_adapter(adapter))

    def get_adapter(self, adapter_id: str) -> Adapter:
        return self._run(calls.get_adapter(adapter_id))

    def list_adapters(self, tenant_id: str | None = None) -> list[Adapter]:
        return self._run(calls.list_adapters(tenant_id))

    def disable_adapter(self, adapter_id: str) -> Adapter:
        return self._run(calls.adapter_status(adapter_id, "disable"))

    def enable_adapter(self, adapter_id: str) -> Adapter:
        return self._run(calls.adapter_status(adapter_id, "enable"))

    def delete_adapter(self, adapter_id: str) -> None:
        self._run(calls.delete_adapter(adapter_id))

    # -- aliases ------------------------------------------------------------------------------

    def set_alias(self, alias: str, adapter_id: str) -> Alias:
        return self._run(calls.set_alias(alias, adapter_id))

    def split_alias(self, alias: str,
                    targets: Mapping[str, float] | Iterable[tuple[str, float]] | Iterable[Mapping[str, Any]]) -> Alias:
        return self._run(calls.split_alias(alias, targets))

    def promote_alias(self, alias: str, adapter_id: str | None = None) -> Alias:
        return self._run(calls.promote_alias(alias, adapter_id))

    def rollback_alias(self, alias: str) -> Alias:
        return self._run(calls.rollback_alias(alias))

    def delete_alias(self, alias: str) -> None:
        self._run(calls.delete_alias(alias))

    def get_alias(self, alias: str) -> Alias:
        return self._run(calls.get_alias(alias))

    def list_aliases(self, tenant_id: str | None = None) -> list[Alias]:
        return self._run(calls.list_aliases(tenant_id))

    def versions(self, alias: str) -> list[AliasVersion]:
        info = self.get_alias(alias)
        return alias_versions(info, self.list_adapters(info["tenant_id"]))

    def alias_metrics(self, alias: str, *, since: str | None = None, window_s: float | None = None,
                      rollout_step: bool = False) -> AliasMetrics:
        return self._run(calls.alias_metrics(alias, since=since, window_s=window_s, rollout_step=rollout_step))

    # -- rollouts -----------------------------------------------------------------------------

    def start_rollout(self, alias: str, adapter_id: str, *, steps: Iterable[int] = (10, 50, 100),
                      interval: str | float = "5m", bounds: RolloutBounds | Mapping[str, Any] | None = None) -> Rollout:
        return self._run(calls.start_rollout(alias, adapter_id, steps=steps, interval=interval, bounds=bounds))

    def get_rollout(self, rollout_id: int) -> Rollout:
        return self._run(calls.get_rollout(rollout_id))

    def list_rollouts(self, alias: str | None = None, state: str | None = None, limit: int = 100) -> list[Rollout]:
        return self._run(calls.list_rollouts(alias, state, limit))

    def abort_rollout(self, rollout_id: int) -> Rollout:
        return self._run(calls.abort_rollout(rollout_id))

    def wait_rollout(self, rollout_id: int, timeout: float | None = None, poll_s: float = 1.0) -> Rollout:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            r = self.get_rollout(rollout_id)
            if r["state"] in TERMINAL_ROLLOUT_STATES:
                return r
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"rollout {rollout_id} still {r['state']} at step {r['percent']}% after {timeout} s")
            time.sleep(poll_s)

    def audit(self, target: str | None = None, *, action: str | None = None, limit: int = 100) -> list[AuditEntry]:
        return self._run(calls.audit(target, action=action, limit=limit))

    # -- foreign workers and critical models ---------------------------------------------------

    def put_worker(self, name: str, url: str, kind: str, api_key_env: str | None = None, weight: float = 1.0) -> dict:
        return self._run(calls.put_worker(name, url, kind, api_key_env, weight))

    def delete_worker(self, name: str) -> None:
        self._run(calls.delete_worker(name))

    def list_workers(self) -> list[dict]:
        return self._run(calls.list_workers())

    def set_critical(self, model: str, critical: bool = True) -> list[dict]:
        return self._run(calls.set_critical(model, critical))

    def list_critical(self) -> list[dict]:
        return self._run(calls.list_critical())
