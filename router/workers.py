"""Foreign workers: servers the farm does not run (any OpenAI-compatible server: vLLM, `transformers
serve`, llama.cpp's server, another gateway; or Ollama), registered with `lorafarm workers add` and
listed in the registry's routing table.

Each is polled at the state-poll cadence:
- kind `openai`: `GET {url}/v1/models`; every listed id is installed; it is loaded when the entry
  says `status: "loaded"` (a string, or `{"value": "loaded"}` as `transformers serve` writes it) or
  carries no status at all (vLLM and llama.cpp list only what they have loaded);
- kind `ollama`: `GET {url}/api/tags` (installed) and `GET {url}/api/ps` (loaded = warm).
A poll that fails keeps the last lists ("possibly warm": routing still tries the worker, behind the
workers that report the model loaded) and counts a failure; after `health_failures` in a row the
worker is out of routing and its models leave the catalog, until a poll succeeds again.

The secret: `api_key_env` names an environment variable of the router, `LORAFARM_WORKER_KEY_<NAME>`
only (`lorafarm.limits`; the CLI and the registry refuse any other name, and should a table row carry
one anyway the router ignores it and sends no key); the key is read from it at request time and sent
as `Authorization: Bearer`, never stored in the registry. Requests to a foreign worker never carry
the farm's admin token.

Catalogs: a worker's names are base models for every tenant, so a name of the shape of our own
aliases (`tenant/name:label`) or adapter ids (`ad-<20 hex>`) is skipped (logged once per worker and
name): a foreign server cannot plant a tenant's alias in everyone's `/v1/models` or catch requests
meant for an adapter. The catalog also skips any name that is an alias or adapter id of the table.

`snapshots()` gives `routing.ReplicaSnapshot`s (replica_id `worker:<name>`, `loaded_models` set) that
join the replicas in `choose()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from dataclasses import dataclass, field

import httpx

from lorafarm.limits import worker_key_env_error
from router.polling import PollGroup
from router.routing import ReplicaSnapshot

log = logging.getLogger("lorafarm.router.workers")

PREFIX = "worker:"
# the shapes of registry.schemas.ALIAS_PATTERN and ADAPTER_ID_PATTERN
_ALIAS_SHAPE = re.compile(r"[a-z0-9][a-z0-9-]{1,62}/[A-Za-z0-9][A-Za-z0-9._-]{0,127}:[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ADAPTER_SHAPE = re.compile(r"ad-[0-9a-f]{20}")


@dataclass
class WorkerEntry:
    name: str
    url: str
    kind: str  # openai | ollama
    api_key_env: str | None = None
    weight: float = 1.0
    installed: tuple[str, ...] = ()
    loaded: frozenset[str] = frozenset()
    polled_ok: bool = False  # the last poll succeeded
    ever_polled: bool = False
    failures: int = 0  # failed polls (or refused connections) in a row
    local_tokens: int = 0
    local_connections: int = 0
    skipped: set[str] = field(default_factory=set)  # listed names refused (logged once each)

    @property
    def replica_id(self) -> str:
        return PREFIX + self.name

    def headers(self) -> dict[str, str]:
        if not self.api_key_env or worker_key_env_error(self.api_key_env):
            return {}  # never another of the router's variables (apply() logged it)
        key = os.environ.get(self.api_key_env)
        return {"authorization": f"Bearer {key}"} if key else {}


def _status_loaded(entry: dict) -> bool:
    status = entry.get("status")
    if status is None:
        return True
    if isinstance(status, dict):
        status = status.get("value")
    return str(status).lower() == "loaded"


def looks_like_ours(name: str) -> bool:
    """A name of the shape of one of our aliases or adapter ids (never a foreign base model)."""
    return bool(_ALIAS_SHAPE.fullmatch(name) or _ADAPTER_SHAPE.fullmatch(name))


def _foreign_names(e: WorkerEntry, installed: list[str], loaded: set[str]) -> tuple[list[str], set[str]]:
    kept = []
    for m in installed:
        if looks_like_ours(m):
            if m not in e.skipped:
                e.skipped.add(m)
                log.warning("foreign worker %s lists %r, which looks like a lorafarm alias or adapter id: "
                            "skipped (foreign catalogs add base models only)", e.name, m)
            continue
        kept.append(m)
    return kept, {m for m in loaded if not looks_like_ours(m)}


def parse_openai_models(body) -> tuple[list[str], set[str]]:
    """`/v1/models` -> (installed ids, loaded ids)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("no data list in /v1/models")
    installed, loaded = [], set()
    for m in data:
        if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]:
            installed.append(m["id"])
            if _status_loaded(m):
                loaded.add(m["id"])
    return installed, loaded


def parse_ollama(tags, ps) -> tuple[list[str], set[str]]:
    """`/api/tags` + `/api/ps` -> (installed names, loaded names)."""
    def names(body) -> list[str]:
        models = body.get("models") if isinstance(body, dict) else None
        if not isinstance(models, list):
            raise ValueError("no models list")
        return [str(m.get("name") or m.get("model")) for m in models if isinstance(m, dict)
                and (m.get("name") or m.get("model"))]

    loaded = set(names(ps))
    installed = list(dict.fromkeys(names(tags) + sorted(loaded)))
    return installed, loaded


class ForeignWorkers:
    def __init__(self, http: httpx.AsyncClient | None = None, *, health_failures: int = 3, timeout: float = 2.0):
        self.http = http
        self.health_failures = health_failures
        self.timeout = timeout
        self.workers: dict[str, WorkerEntry] = {}  # by replica_id (worker:<name>)
        self.version = 0  # bumped when the set of listed models may have changed
        self._polls = PollGroup()

    # -- registry table ----------------------------------------------------------------------

    def apply(self, rows: list[dict] | None) -> None:
        seen = set()
        for r in rows or ():
            if not isinstance(r, dict) or not r.get("name") or not r.get("url"):
                continue
            rid = PREFIX + str(r["name"])
            seen.add(rid)
            url = str(r["url"]).rstrip("/")
            kind = str(r.get("kind") or "openai")
            e = self.workers.get(rid)
            if e is None or e.url != url or e.kind != kind:
                e = self.workers[rid] = WorkerEntry(name=str(r["name"]), url=url, kind=kind)
                log.info("foreign worker %s (%s) at %s joined", e.name, kind, url)
            key_env = r.get("api_key_env") or None
            if key_env is not None and worker_key_env_error(str(key_env)):
                if e.api_key_env != key_env:
                    log.error("foreign worker %s: api_key_env %r is not LORAFARM_WORKER_KEY_*; no key is sent",
                              e.name, key_env)
            e.api_key_env = key_env
            try:
                e.weight = float(r.get("weight") or 1.0)
            except (TypeError, ValueError):
                e.weight = 1.0
        for rid in [rid for rid in self.workers if rid not in seen]:
            log.info("foreign worker %s removed", rid)
            del self.workers[rid]
        self.version += 1

    # -- polling -----------------------------------------------------------------------------

    async def poll(self, wait: float | None = None) -> None:
        await self._polls.run(self.workers, self._poll_one, wait)
        self.version += 1

    def cancel(self) -> None:
        self._polls.cancel()

    async def _get(self, e: WorkerEntry, path: str):
        assert self.http is not None
        r = await self.http.get(e.url + path, headers=e.headers(), timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    async def _poll_one(self, e: WorkerEntry) -> None:
        try:
            if e.kind == "ollama":
                tags, ps = await asyncio.gather(self._get(e, "/api/tags"), self._get(e, "/api/ps"))
                installed, loaded = parse_ollama(tags, ps)
            else:
                installed, loaded = parse_openai_models(await self._get(e, "/v1/models"))
        except (httpx.HTTPError, ValueError, json.JSONDecodeError) as err:
            if e.polled_ok or not e.ever_polled:
                log.info("foreign worker %s: catalog unavailable (%s); possibly warm", e.name, type(err).__name__)
            e.polled_ok = False
            e.ever_polled = True
            self.mark_failure(e.replica_id, "catalog poll failed")
            return
        if e.failures >= self.health_failures:
            log.info("foreign worker %s is back", e.name)
        installed, loaded = _foreign_names(e, installed, loaded)
        e.installed, e.loaded = tuple(installed), frozenset(loaded)
        e.polled_ok = e.ever_polled = True
        e.failures = 0

    # -- request path ------------------------------------------------------------------------

    def is_worker(self, replica_id: str) -> bool:
        return replica_id in self.workers

    def headers_for(self, replica_id: str, base: dict[str, str]) -> dict[str, str]:
        """What a request to `replica_id` carries: the worker's own key instead of the admin token and
        no lorafarm-internal headers."""
        e = self.workers[replica_id]
        h = {k: v for k, v in base.items()
             if k.lower() not in ("authorization", "x-lorafarm-tenant", "x-lorafarm-tenant-weight")}
        h.update(e.headers())
        return h

    def mark_failure(self, replica_id: str, why: str = "") -> None:
        e = self.workers.get(replica_id)
        if e is None:
            return
        e.failures += 1
        if e.failures == self.health_failures:
            log.warning("foreign worker %s out of routing after %d failures in a row (%s)", e.name, e.failures, why)
            self.version += 1

    def mark_success(self, replica_id: str) -> None:
        e = self.workers.get(replica_id)
        if e is not None and e.failures:
            e.failures = 0
            self.version += 1

    def acquire(self, replica_id: str, tokens: int) -> None:
        e = self.workers.get(replica_id)
        if e is not None:
            e.local_tokens += tokens
            e.local_connections += 1

    def release(self, replica_id: str, tokens: int) -> None:
        e = self.workers.get(replica_id)
        if e is not None:
            e.local_tokens = max(0, e.local_tokens - tokens)
            e.local_connections = max(0, e.local_connections - 1)

    # -- for routing and the catalog ---------------------------------------------------------

    def healthy(self, e: WorkerEntry) -> bool:
        return e.failures < self.health_failures

    def snapshots(self) -> tuple[ReplicaSnapshot, ...]:
        return tuple(
            ReplicaSnapshot(
                replica_id=e.replica_id,
                url=e.url,
                models=frozenset(e.installed),
                loaded_models=e.loaded,
                capacity_weight=e.weight,
                tokens_in_flight=e.local_tokens,
                connections=e.local_connections,
                healthy=self.healthy(e),
                state_fresh=e.polled_ok,
            )
            for e in self.workers.values()
        )

    def listed_models(self) -> set[str]:
        """Models of the workers still in routing (the catalog lists these)."""
        return {m for e in self.workers.values() if self.healthy(e) for m in e.installed}

    def known_models(self) -> set[str]:
        """Every model any worker has listed: still resolvable (then a clear 503) when its workers are down."""
        return {m for e in self.workers.values() for m in e.installed}

    def status(self) -> list[dict]:
        return [{"worker": e.name, "kind": e.kind, "url": e.url, "healthy": self.healthy(e),
                 "catalog_fresh": e.polled_ok, "models": list(e.installed), "loaded": sorted(e.loaded),
                 "weight": e.weight} for e in self.workers.values()]


def openai_error_body(status: int, body: bytes) -> bytes:
    """A foreign worker's error answer as an OpenAI error object (Ollama and others send
    `{"error": "text"}` or plain text)."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict) and "message" in obj["error"]:
        return body
    if isinstance(obj, dict) and obj.get("error"):
        message = str(obj["error"])
    elif isinstance(obj, dict) and obj.get("detail"):
        message = str(obj["detail"])
    else:
        message = body.decode("utf-8", "replace").strip()[:500] or f"upstream answered HTTP {status}"
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = "model_not_found" if status == 404 else ("upstream_error" if status >= 500 else None)
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
