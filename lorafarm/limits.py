"""Limits and rules the router, the replicas and the registry must agree on (one definition each).

- `MAX_N`: choices per request (`n`). The router refuses more with a 400 before charging the
  tenant, the replica's request schema refuses the same.
- `WORKER_KEY_ENV_PREFIX`: a foreign worker's `api_key_env` must name an environment variable with
  this prefix. The router sends the value of that variable to the worker as its bearer key, so any
  other name (`LORAFARM_ADMIN_TOKEN`, `HOME`, a cloud credential) would send the router host's
  secrets to a server the farm does not run. Refused by the CLI, the registry API (400) and, should
  a table row carry one anyway, ignored by the router.
"""

from __future__ import annotations

import re

MAX_N = 16

WORKER_KEY_ENV_PREFIX = "LORAFARM_WORKER_KEY_"
WORKER_KEY_ENV_PATTERN = r"^LORAFARM_WORKER_KEY_[A-Z0-9_]{1,100}$"


def worker_key_env_error(name: str | None) -> str | None:
    """Why `name` may not be a worker's `api_key_env` (None: it may)."""
    if name is None:
        return None
    if not isinstance(name, str) or not re.fullmatch(WORKER_KEY_ENV_PATTERN, name):
        return (f"api_key_env {name!r} is refused: it must name an environment variable "
                f"{WORKER_KEY_ENV_PREFIX}<NAME> (A-Z, 0-9, _), never another of the router's variables")
    return None
