"""Shared settings helpers: `LORAFARM_*` environment defaults and the farm.json lookup.

Admin commands find the registry URL and admin token in this order: the command-line flag, the
environment (`LORAFARM_REGISTRY_URL`, `LORAFARM_ADMIN_TOKEN`), then farm.json written by
`lorafarm up` (`--farm PATH`, else `$LORAFARM_FARM_JSON`, else `<state-dir>/farm.json` with
`$LORAFARM_STATE_DIR` or `./var`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lorafarm.errors import CliError

DEFAULT_STATE_DIR = "var"
DEFAULT_REGISTRY_URL = "http://127.0.0.1:8100"


def env(name: str, default: str | None = None) -> str | None:
    """`$LORAFARM_<NAME>` (name given without the prefix, any case), or `default` when unset/empty."""
    value = os.environ.get(f"LORAFARM_{name.upper()}")
    return value if value else default


def state_dir(value: str | os.PathLike | None = None) -> Path:
    return Path(value or env("STATE_DIR", DEFAULT_STATE_DIR))


def farm_json_path(farm: str | os.PathLike | None = None, state: str | os.PathLike | None = None) -> Path:
    """Where farm.json is looked for (it may not exist)."""
    if farm:
        return Path(farm)
    if env("FARM_JSON"):
        return Path(env("FARM_JSON"))
    return state_dir(state) / "farm.json"


def load_farm_json(farm: str | os.PathLike | None = None, state: str | os.PathLike | None = None) -> dict:
    """farm.json as a dict; {} when absent. An explicitly named file that is missing or broken is an error."""
    path = farm_json_path(farm, state)
    if not path.exists():
        if farm:
            raise CliError(f"--farm {path}: no such file")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"{path}: not a readable farm.json ({e})") from e
    return data if isinstance(data, dict) else {}


def registry_connection(
    url: str | None = None, token: str | None = None, farm: str | os.PathLike | None = None
) -> tuple[str, str | None]:
    """(registry URL, admin token) from flags, then environment, then farm.json, then the default URL."""
    url = url or env("REGISTRY_URL")
    token = token or env("ADMIN_TOKEN")
    if not url or not token:
        data = load_farm_json(farm)
        url = url or data.get("registry_url")
        token = token or data.get("admin_token")
    return (url or DEFAULT_REGISTRY_URL).rstrip("/"), token
