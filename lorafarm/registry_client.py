"""The registry's async client under its historical name: `RegistryClient` is
`lorafarm.client.AsyncLorafarmClient` and `RegistryError` is `lorafarm.client.LorafarmError`
(one client, kept in `lorafarm/client/`; this module only re-exports it for the services)."""

from __future__ import annotations

from lorafarm.client._calls import DEFAULT_REGISTRY_URL
from lorafarm.client.aio import AsyncLorafarmClient as RegistryClient
from lorafarm.client.errors import LorafarmError as RegistryError

__all__ = ["DEFAULT_REGISTRY_URL", "RegistryClient", "RegistryError"]
