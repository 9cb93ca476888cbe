"""The Python client of lorafarm's registry, sync and async (httpx), typed.

    from lorafarm.client import LorafarmClient

    with LorafarmClient("http://127.0.0.1:8100", admin_token) as reg:
        v8 = reg.upload_adapter("out/adapter", "acme", tags={"run": "sft-3", "step": 400})
        reg.start_rollout("acme/support:prod", v8["adapter_id"], steps=(10, 50, 100), interval="5m")

`AsyncLorafarmClient` is the same API with `await` (and the services' own calls). Errors raise
`LorafarmError` subclasses carrying the registry's message and code. docs/api.md, "Python client".
"""

from lorafarm.client._calls import DEFAULT_REGISTRY_URL, parse_duration
from lorafarm.client.aio import AsyncLorafarmClient
from lorafarm.client.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    LorafarmError,
    NotFoundError,
    RegistryError,
    UnavailableError,
)
from lorafarm.client.summary import VersionCounts
from lorafarm.client.sync import LorafarmClient

__all__ = [
    "DEFAULT_REGISTRY_URL",
    "AsyncLorafarmClient",
    "AuthenticationError",
    "ConflictError",
    "InvalidRequestError",
    "LorafarmClient",
    "LorafarmError",
    "NotFoundError",
    "RegistryError",
    "UnavailableError",
    "VersionCounts",
    "parse_duration",
]
