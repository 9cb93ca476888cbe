"""`GET /v1/models` and model-name resolution for one tenant.

The catalog is the de-duplicated union of the models every routable replica serves (base and
embedding models from its last state report, else from its registry entry), rebuilt when the view
changes (at the state-poll cadence) and served from cache, plus the caller's adapters, each listed
once under the name it is deployed as: its alias (one entry per alias), or its id when no alias
points at it (an older version kept callable after a deploy or rollback). Every adapter entry has
`root` = the adapter id and `parent` = its base model (vLLM's convention for adapters) and
`adapter_id` beside them. An aliased adapter is still callable by its id, and `GET /v1/models/{id}`
answers an alias, an adapter id or a base model, listed or not. (Listing every adapter under both
its alias and its id put each deployed adapter in the list twice.)

Resolution: a tenant reaches its own aliases, its own adapter ids and the base models; anything
else, existing or not, is `model_not_found` (the same answer either way, so a tenant cannot probe
for another's names). An alias with a traffic split (issue 38) resolves to one of its split's
versions per request, weight-proportionally, sticky per end user when the caller passes one
(`router.routing.pick_version`); a version of the split that is not active (disabled since) is never
chosen: its share goes to the others, and to the stable version when none is left. It is listed under
its stable version (`root`).

Foreign workers add base models only: a name a worker lists that is one of the table's aliases or
adapter ids (or has their shape: `router.workers` skips those) is neither listed nor resolved.

Endpoint check (`wrong_endpoint`): a model only embedding workers serve, sent to chat/completions,
and an adapter, alias or model only generating replicas serve, sent to `/v1/embeddings`, are the
client's mistake: a 400 naming the right endpoint, not a 503 "no replica". The task of a model is
learned from the replicas' state reports (`task`) and kept while the router runs; a foreign worker's
models have no known task and are not checked."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from router.routing import pick_version
from router.view import ReplicaView, RoutingTable

OWNED_BY = "lorafarm"


@dataclass(frozen=True)
class Resolved:
    """What a request's `model` names, for one tenant."""

    requested: str
    kind: str  # "adapter" | "base"
    upstream_model: str  # the `model` sent to the replica: the adapter id or the base model name
    adapter_id: str | None = None
    alias: str | None = None
    base_model_hash: str | None = None
    base_model_name: str | None = None
    owners_k: int = 2
    split: bool = False  # resolved through an alias's traffic split (per-version metrics count it)


class ModelNotFound(Exception):
    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.")
        self.model = model


class Catalog:
    def __init__(self, view: ReplicaView, default_owners_k: int = 2):
        self.view = view
        self.default_owners_k = default_owners_k
        self._built_for = -1
        self._base: list[dict] = []
        self._served: set[str] = set()
        self._hash_names: dict[str, str] = {}
        self._created = int(time.time())
        self.workers = None  # router.workers.ForeignWorkers: their models join the union
        self._ids_for: tuple[object, dict[str, list[str]]] = (None, {})
        self._tasks: dict[str, set[str]] = {}  # model -> tasks ("embed", "generate") replicas reported for it

    # -- union of replica models, cached ---------------------------------------------------

    def _refresh(self) -> None:
        version = (self.view.catalog_version, self.workers.version if self.workers is not None else 0)
        if self._built_for == version:
            return
        table = self.view.table
        served: dict[str, str] = {}  # model name -> base_model_hash of a replica serving it
        for e in self.view.replicas.values():  # what each model is for, whether in routing or not
            if e.state is not None:
                for m in e.state.models or ():
                    self._tasks.setdefault(m, set()).add(e.state.task)
        for e in self.view.routable():
            models = list(e.state.models) if e.state is not None and e.state.models else list(e.models)
            h = (e.state.base_model_hash if e.state is not None else "") or e.base_model_hash
            for m in models:
                if m not in table.adapters:  # a merged-mode replica's adapter is its tenant's, not a base
                    served.setdefault(m, h)
        hash_names: dict[str, str] = {}
        for name, h in sorted(table.base_models.items()):
            if name not in table.adapters:
                hash_names.setdefault(h, name)
        for name, h in sorted(served.items()):
            if h:
                hash_names.setdefault(h, name)
        listed = set(served)
        self._served = set(served)
        if self.workers is not None:  # foreign workers: listed while in routing, resolvable (-> 503) after
            ours = set(table.aliases) | set(table.adapters)  # base models only: never one of our names
            listed |= self.workers.listed_models() - ours
            self._served |= self.workers.known_models() - ours
        self._hash_names = hash_names
        self._base = [
            {"id": name, "object": "model", "created": self._created, "owned_by": OWNED_BY}
            for name in sorted(listed)
        ]
        self._built_for = version

    def base_models(self) -> list[dict]:
        self._refresh()
        return list(self._base)

    def base_name_for_hash(self, base_model_hash: str) -> str | None:
        self._refresh()
        return self._hash_names.get(base_model_hash)

    def models_for(self, tenant_id: str) -> dict:
        """The OpenAI list answer for `tenant_id`."""
        self._refresh()
        table = self.view.table
        data = list(self._base)
        aliased: set[str] = set()
        for alias in table.tenant_aliases.get(tenant_id, ()):
            adapter_id = table.aliases[alias]["adapter_id"]
            adapter = table.adapters.get(adapter_id)
            if adapter is None or not _active(adapter):
                continue
            data.append(self._adapter_entry(tenant_id, alias, adapter_id, adapter))
            aliased.add(adapter_id)
        for adapter_id in self._tenant_adapters(table).get(tenant_id, ()):
            if adapter_id not in aliased:  # listed under its alias already
                data.append(self._adapter_entry(tenant_id, adapter_id, adapter_id, table.adapters[adapter_id]))
        return {"object": "list", "data": data}

    def model_for(self, tenant_id: str, model: str) -> dict:
        """`GET /v1/models/{model}`: an entry of the tenant's list, or the entry of one of its active
        adapters by id (listed under its alias), else ModelNotFound."""
        for entry in self.models_for(tenant_id)["data"]:
            if entry["id"] == model:
                return entry
        adapter = self.view.table.adapters.get(model)
        if adapter is not None and str(adapter.get("tenant_id") or "") == tenant_id and _active(adapter):
            return self._adapter_entry(tenant_id, model, model, adapter)
        raise ModelNotFound(model)

    def _adapter_entry(self, tenant_id: str, name: str, adapter_id: str, adapter: dict) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": tenant_id,
            "root": adapter_id,
            "parent": self._hash_names.get(str(adapter.get("base_model_hash") or "")),
            "adapter_id": adapter_id,
        }

    def _tenant_adapters(self, table: RoutingTable) -> dict[str, list[str]]:
        """tenant -> its active adapter ids (every version it may call by id), per table version."""
        if self._ids_for[0] is not table:
            by_tenant: dict[str, list[str]] = {}
            for adapter_id, adapter in sorted(table.adapters.items()):
                if _active(adapter) and adapter.get("tenant_id"):
                    by_tenant.setdefault(str(adapter["tenant_id"]), []).append(adapter_id)
            self._ids_for = (table, by_tenant)
        return self._ids_for[1]

    # -- resolution -------------------------------------------------------------------------

    def resolve(self, tenant_id: str, model: str, user: str | None = None, rng=None) -> Resolved:
        """`user`: the end user the request names (OpenAI `user`, x-lorafarm-user): a split alias
        gives the same user the same version; without one each request is drawn (`rng`)."""
        self._refresh()
        table: RoutingTable = self.view.table
        alias = table.aliases.get(model)
        if alias is not None:
            if alias.get("tenant_id") != tenant_id:
                raise ModelNotFound(model)
            split = table.splits.get(model)
            if split:
                live = tuple((a, w) for a, w in split if _active(table.adapters.get(a) or {"status": "deleted"}))
                if live:
                    chosen = pick_version(model, live, user, rng)
                    return replace(self._adapter(tenant_id, model, chosen, alias=model), split=True)
            return self._adapter(tenant_id, model, str(alias.get("adapter_id") or ""), alias=model)
        if model in table.adapters:
            return self._adapter(tenant_id, model, model)
        if model in table.base_models or model in self._served:
            h = table.base_models.get(model)
            return Resolved(
                requested=model, kind="base", upstream_model=model, base_model_hash=h, base_model_name=model
            )
        raise ModelNotFound(model)

    def _adapter(self, tenant_id: str, requested: str, adapter_id: str, alias: str | None = None) -> Resolved:
        adapter = self.view.table.adapters.get(adapter_id)
        if adapter is None or adapter.get("tenant_id") != tenant_id or not _active(adapter):
            raise ModelNotFound(requested)
        h = str(adapter.get("base_model_hash") or "")
        try:
            k = int(adapter.get("owners_k") or self.default_owners_k)
        except (TypeError, ValueError):
            k = self.default_owners_k
        return Resolved(
            requested=requested,
            kind="adapter",
            upstream_model=adapter_id,
            adapter_id=adapter_id,
            alias=alias,
            base_model_hash=h or None,
            base_model_name=self._hash_names.get(h),
            owners_k=max(1, k),
        )


    def wrong_endpoint(self, resolved: Resolved, embeddings: bool) -> tuple[str, str] | None:
        """(message, code) when `resolved` is not a model of that endpoint (see the module docstring)."""
        if embeddings:
            if resolved.kind == "adapter":
                return (f"`{resolved.requested}` is a chat model (a LoRA adapter); /v1/embeddings needs an "
                        "embedding model", "model_not_embedding")
            tasks = self._tasks.get(resolved.upstream_model, set())
            if tasks and "embed" not in tasks:
                return (f"`{resolved.requested}` is a chat model; /v1/embeddings needs an embedding model",
                        "model_not_embedding")
            return None
        tasks = self._tasks.get(resolved.upstream_model, set()) if resolved.kind == "base" else set()
        if tasks and "generate" not in tasks:
            return (f"`{resolved.requested}` is an embedding model: use /v1/embeddings", "model_not_chat")
        return None


def _active(adapter: dict) -> bool:
    return str(adapter.get("status") or "active").lower() not in _INACTIVE


_INACTIVE = {"deleted", "disabled", "revoked", "failed", "archived", "quarantined", "inactive"}
