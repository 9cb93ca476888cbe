"""Each registry call described once, as data (`Call`): method, path, body, which non-2xx statuses
are answers, how the answer is read. The async and the sync clients only run them, so both speak
exactly the same API."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from lorafarm.client.errors import LorafarmError, error_for

DEFAULT_REGISTRY_URL = "http://127.0.0.1:8100"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def _json_body(response: httpx.Response) -> Any:
    if response.status_code == 204 or not response.content:
        return None
    return response.json()


@dataclass
class Call:
    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    data: dict[str, str] | None = None
    # multipart files, opened only when the call runs: -> (files for httpx, handles to close)
    files: Callable[[], tuple[list, list]] | None = None
    headers: dict[str, str] | None = None
    ok: tuple[int, ...] = ()  # non-2xx statuses that are answers, not errors
    parse: Callable[[httpx.Response], Any] = _json_body
    timeout: Any = None  # httpx timeout for this call (None: the client's)

    def request_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        for name in ("params", "json", "data", "headers"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.timeout is not None:
            kw["timeout"] = self.timeout
        return kw


# -- plumbing shared by both clients ---------------------------------------------------------------


def alias_path(alias: str) -> str:
    # `acme/support:prod` -> `acme/support:prod`: the slash between tenant and name is a path
    # separator on the server (routes /internal/aliases/{tenant_id}/{name}); other characters quoted.
    return "/".join(quote(part, safe=":") for part in alias.split("/", 1))


def seg(value: str) -> str:
    return quote(str(value), safe="")


def error_message(response: httpx.Response) -> str:
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


def _error_field(response: httpx.Response, name: str) -> str | None:
    try:
        err = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    value = err.get(name) if isinstance(err, dict) else None
    return str(value) if value is not None else None


def error_code(response: httpx.Response) -> str | None:
    return _error_field(response, "code")


def raise_for(response: httpx.Response) -> LorafarmError:
    return error_for(response.status_code, error_message(response), error_code(response),
                     _error_field(response, "param"))


def unreachable(url: str, e: BaseException) -> LorafarmError:
    return error_for(0, f"registry at {url} unreachable: {e.__class__.__name__}: {e}")


def actor() -> str:
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


def connection(url: str | None, token: str | None) -> tuple[str, str | None, dict[str, str]]:
    """(base URL, token, default headers) from the arguments, else $LORAFARM_REGISTRY_URL / $LORAFARM_ADMIN_TOKEN."""
    url = (url or os.environ.get("LORAFARM_REGISTRY_URL") or DEFAULT_REGISTRY_URL).rstrip("/")
    token = token if token is not None else os.environ.get("LORAFARM_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers["x-lorafarm-actor"] = actor()  # who, for the registry's audit trail
    return url, token, headers


def parse_duration(value: str | float | int) -> float:
    """Seconds from `90`, `90s`, `500ms`, `5m`, `1h`, `1d` (a number alone is seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        units = (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0), ("d", 86400.0))
        for suffix, factor in units:
            if text.endswith(suffix) and text[: -len(suffix)].strip():
                number = text[: -len(suffix)].strip()
                break
        else:
            number, factor = text, 1.0
        try:
            seconds = float(number) * factor
        except ValueError:
            raise ValueError(f"{value!r} is not a duration (e.g. 30s, 5m, 1h)") from None
    if not (seconds > 0 and seconds != float("inf")):
        raise ValueError(f"{value!r}: a duration must be positive")
    return seconds


# -- tenants and keys ------------------------------------------------------------------------------


def create_tenant(name: str, requests_per_s: float | None = None, tokens_per_s: float | None = None) -> Call:
    body: dict[str, Any] = {"name": name}
    if requests_per_s is not None:
        body["requests_per_s"] = requests_per_s
    if tokens_per_s is not None:
        body["tokens_per_s"] = tokens_per_s
    return Call("POST", "/internal/tenants", json=body)


def list_tenants() -> Call:
    return Call("GET", "/internal/tenants")


def create_key(tenant_id: str) -> Call:
    return Call("POST", f"/internal/tenants/{seg(tenant_id)}/keys")


def list_keys(tenant_id: str) -> Call:
    return Call("GET", f"/internal/tenants/{seg(tenant_id)}/keys")


def revoke_key(tenant_id: str, key_id: str) -> Call:
    return Call("DELETE", f"/internal/tenants/{seg(tenant_id)}/keys/{seg(key_id)}")


def set_tenant_limits(tenant_id: str, limits: Mapping[str, float | None]) -> Call:
    return Call("PATCH", f"/internal/tenants/{seg(tenant_id)}", json=dict(limits))


def rotate_keys(tenant_id: str, key_id: str | None = None) -> Call:
    return Call("POST", f"/internal/tenants/{seg(tenant_id)}/keys/rotate",
                params={"key_id": key_id} if key_id else None)


def verify_api_key(api_key: str) -> Call:
    def parse(response: httpx.Response) -> dict | None:
        if response.status_code == 401:
            # 401 is also the answer to a wrong *admin* token: tell the two apart by error code.
            if error_code(response) != "invalid_api_key":
                raise raise_for(response)
            return None
        return response.json()

    return Call("POST", "/internal/auth/verify", json={"api_key": api_key}, ok=(401,), parse=parse)


# -- adapters --------------------------------------------------------------------------------------


def register_adapter(adapter: Mapping[str, Any]) -> Call:
    return Call("POST", "/internal/adapters", json=dict(adapter))


def upload_adapter(
    peft_dir: str | os.PathLike,
    tenant_id: str,
    alias: str | None = None,
    base_model: str | None = None,
    *,
    version: str | int | None = None,
    base_model_hash: str | None = None,
    assume_base: bool = False,
    tags: Mapping[str, Any] | None = None,
) -> Call:
    """The multipart upload of a PEFT folder (or a tar of one); the registry builds, signs, stores
    and registers the archive (as `lorafarm adapters upload` always did)."""
    from archives.basehash import read_trained_base
    from archives.errors import ArchiveError

    path = Path(peft_dir)
    data: dict[str, str] = {"tenant_id": tenant_id}
    if base_model_hash is None and path.is_dir():
        try:
            base_model_hash = read_trained_base(path)
        except ArchiveError as e:
            raise error_for(0, str(e)) from None
    if base_model_hash:
        data["base_model_hash"] = base_model_hash
    if assume_base:
        data["assume_base"] = "true"
    if alias:
        data["alias"] = alias
    if base_model:
        data["base_model"] = base_model
    if version is not None and version != "":
        data["version"] = str(version)
    if tags:
        data["tags"] = json.dumps(dict(tags), sort_keys=True, default=str)
    if path.is_dir():
        if not any((path / name).is_file() for name in ADAPTER_FILES):
            raise error_for(0, f"{path} holds no adapter_config.json / adapter weights")
    elif not path.is_file():
        raise error_for(0, f"{path}: no such folder or file")

    def files() -> tuple[list, list]:
        handles: list = []
        out: list = []
        try:
            if path.is_dir():
                for name in ADAPTER_FILES:
                    if (path / name).is_file():
                        fh = open(path / name, "rb")
                        handles.append(fh)
                        out.append(("files", (name, fh, "application/octet-stream")))
            else:
                fh = open(path, "rb")
                handles.append(fh)
                out.append(("archive", (path.name, fh, "application/x-tar")))
        except BaseException:
            for fh in handles:
                fh.close()
            raise
        return out, handles

    return Call("POST", "/internal/adapters/upload", data=data, files=files)


def get_adapter(adapter_id: str) -> Call:
    return Call("GET", f"/internal/adapters/{seg(adapter_id)}")


def list_adapters(tenant_id: str | None = None) -> Call:
    return Call("GET", "/internal/adapters", params={"tenant_id": tenant_id} if tenant_id else None)


def adapter_status(adapter_id: str, action: str) -> Call:  # disable | enable
    return Call("POST", f"/internal/adapters/{seg(adapter_id)}/{action}")


def delete_adapter(adapter_id: str) -> Call:
    return Call("DELETE", f"/internal/adapters/{seg(adapter_id)}")


# -- aliases, splits, rollouts ---------------------------------------------------------------------


def set_alias(alias: str, adapter_id: str) -> Call:
    return Call("PUT", f"/internal/aliases/{alias_path(alias)}", json={"adapter_id": adapter_id})


def split_targets(targets: Mapping[str, float] | Iterable[tuple[str, float]] | Iterable[Mapping[str, Any]]) -> list:
    """{id: weight}, [(id, weight)] or [{adapter_id, weight}] -> [{adapter_id, weight}]."""
    if isinstance(targets, Mapping):
        items = list(targets.items())
    else:
        items = [(t["adapter_id"], t["weight"]) if isinstance(t, Mapping) else tuple(t) for t in targets]
    return [{"adapter_id": str(a), "weight": float(w)} for a, w in items]


def split_alias(alias: str, targets) -> Call:
    return Call("PUT", f"/internal/aliases/{alias_path(alias)}/split", json={"targets": split_targets(targets)})


def promote_alias(alias: str, adapter_id: str | None = None) -> Call:
    return Call("POST", f"/internal/aliases/{alias_path(alias)}/promote",
                json={"adapter_id": adapter_id} if adapter_id else {})


def rollback_alias(alias: str) -> Call:
    return Call("POST", f"/internal/aliases/{alias_path(alias)}/rollback")


def delete_alias(alias: str) -> Call:
    return Call("DELETE", f"/internal/aliases/{alias_path(alias)}")


def get_alias(alias: str) -> Call:
    return Call("GET", f"/internal/aliases/{alias_path(alias)}")


def list_aliases(tenant_id: str | None = None) -> Call:
    return Call("GET", "/internal/aliases", params={"tenant_id": tenant_id} if tenant_id else None)


def alias_metrics(alias: str, *, since: str | None = None, window_s: float | None = None,
                  rollout_step: bool = False) -> Call:
    params: dict[str, Any] = {}
    if since:
        params["since"] = since
    if window_s is not None:
        params["window_s"] = f"{float(window_s):g}"
    if rollout_step:
        params["rollout_step"] = "true"
    return Call("GET", f"/internal/aliases/{alias_path(alias)}/metrics", params=params or None)


def start_rollout(alias: str, adapter_id: str, *, steps: Iterable[int] = (10, 50, 100),
                  interval: str | float = "5m", bounds: Mapping[str, Any] | None = None) -> Call:
    body: dict[str, Any] = {"alias": alias, "adapter_id": adapter_id, "steps": [int(s) for s in steps],
                            "interval_s": parse_duration(interval)}
    if bounds:
        body["bounds"] = {k: v for k, v in dict(bounds).items() if v is not None}
    return Call("POST", "/internal/rollouts", json=body)


def get_rollout(rollout_id: int) -> Call:
    return Call("GET", f"/internal/rollouts/{int(rollout_id)}")


def list_rollouts(alias: str | None = None, state: str | None = None, limit: int = 100) -> Call:
    params = {k: v for k, v in {"alias": alias, "state": state, "limit": limit}.items() if v is not None}
    return Call("GET", "/internal/rollouts", params=params)


def abort_rollout(rollout_id: int) -> Call:
    return Call("POST", f"/internal/rollouts/{int(rollout_id)}/abort")


def audit(target: str | None = None, *, action: str | None = None, limit: int = 100) -> Call:
    params = {k: v for k, v in {"target": target, "action": action, "limit": limit}.items() if v is not None}
    return Call("GET", "/internal/audit", params=params)


# -- replicas, placements, workers, stats, routing (the services' calls) ---------------------------


def join_replica(replica_id: str, url: str, base_model_hash: str, models: list[str],
                 capacity_weight: float = 1.0) -> Call:
    body = {"replica_id": replica_id, "url": url, "base_model_hash": base_model_hash, "models": list(models),
            "capacity_weight": capacity_weight}
    return Call("POST", "/internal/replicas/join", json=body)


def heartbeat(replica_id: str, state: Any = None) -> Call:
    if state is not None and hasattr(state, "model_dump"):
        state = state.model_dump(mode="json")
    return Call("POST", f"/internal/replicas/{seg(replica_id)}/heartbeat", json=state)


def list_replicas() -> Call:
    return Call("GET", "/internal/replicas")


def placement(adapter_id: str) -> Call:
    return Call("GET", f"/internal/placements/{seg(adapter_id)}")


def placements_for_replica(replica_id: str) -> Call:
    return Call("GET", "/internal/placements", params={"replica_id": replica_id})


def put_worker(name: str, url: str, kind: str, api_key_env: str | None = None, weight: float = 1.0) -> Call:
    body = {"url": url, "kind": kind, "api_key_env": api_key_env, "weight": weight}
    return Call("PUT", f"/internal/workers/{seg(name)}", json=body)


def delete_worker(name: str) -> Call:
    return Call("DELETE", f"/internal/workers/{seg(name)}", parse=lambda r: None)


def list_workers() -> Call:
    return Call("GET", "/internal/workers")


def set_critical(model: str, critical: bool = True) -> Call:
    return Call("POST", "/internal/models/critical", json={"model": model, "critical": critical})


def list_critical() -> Call:
    return Call("GET", "/internal/models/critical")


def push_stats(window_s: float, adapters: Iterable[Mapping[str, Any]]) -> Call:
    return Call("POST", "/internal/stats", json={"window_s": window_s, "adapters": [dict(a) for a in adapters]})


def push_version_stats(window_s: float, versions: Iterable[Mapping[str, Any]], router_id: str | None = None) -> Call:
    body: dict[str, Any] = {"window_s": window_s, "versions": [dict(v) for v in versions]}
    if router_id:
        body["router_id"] = router_id[:64]
    return Call("POST", "/internal/stats/versions", json=body)


def routing_table(etag: str | None, wait: float, router_id: str | None, read_timeout: float | None) -> Call:
    headers = {"If-None-Match": etag} if etag else {}
    if router_id:
        headers["X-Lorafarm-Router"] = router_id

    def parse(response: httpx.Response) -> tuple[dict | None, str | None]:
        new_etag = response.headers.get("etag", etag)
        if response.status_code == 304:
            return None, new_etag
        return response.json(), new_etag

    call = Call("GET", "/internal/routing", headers=headers, ok=(304,), parse=parse)
    if wait > 0:
        call.params = {"wait": f"{wait:g}"}
        call.timeout = (read_timeout + wait) if read_timeout else None
        if call.timeout is None:
            call.timeout = httpx.Timeout(None)
    return call

