"""The production adapter source: the registry says what exists and where its archive lies."""

from __future__ import annotations

import time
from pathlib import Path

from handler.adapters.errors import AdapterLoadError, AdapterNotFoundError
from handler.adapters.sources.store import StoreFetch
from lorafarm.registry_client import RegistryError


class RegistrySource(StoreFetch):
    """Production source: adapter metadata from the registry; bytes from the object store when one is
    configured (weights_uri must be inside it), else the registry's archive download."""

    POSITIVE_TTL_S = 60.0  # adapter ids are immutable: metadata may be cached
    NEGATIVE_TTL_S = 2.0  # "unknown" is cached briefly, so junk model names don't hammer the registry

    def __init__(self, client, store=None, *, owns_client: bool = False):
        super().__init__(store)
        self.client = client
        self._owns_client = owns_client
        self._uris: dict[str, str | None] = {}
        self._known: dict[str, tuple[float, dict | None]] = {}  # adapter_id -> (expires, adapter or None)

    async def _describe(self, adapter_id: str) -> dict | None:
        hit = self._known.get(adapter_id)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            ad = await self.client.get_adapter(adapter_id)
        except RegistryError as e:
            if e.status == 404:
                self._remember(adapter_id, None, now + self.NEGATIVE_TTL_S)
                return None
            raise
        self._uris[adapter_id] = ad.get("weights_uri")
        self._remember(adapter_id, ad, now + self.POSITIVE_TTL_S)
        return ad

    def _remember(self, adapter_id: str, ad: dict | None, expires: float) -> None:
        if len(self._known) > 50_000:  # bounded: drop the expired, then the oldest half
            now = time.monotonic()
            self._known = {k: v for k, v in self._known.items() if v[0] > now}
            if len(self._known) > 25_000:
                self._known = dict(list(self._known.items())[-25_000:])
        self._known[adapter_id] = (expires, ad)

    async def exists(self, adapter_id: str) -> bool:
        ad = await self._describe(adapter_id)
        return ad is not None and ad.get("status", "active") not in ("deleted", "disabled")

    async def _weights_uri(self, adapter_id: str) -> str:
        uri = self._uris.get(adapter_id)
        if uri is None:
            ad = await self._describe(adapter_id)
            if ad is None:
                raise AdapterNotFoundError(adapter_id)
            uri = ad.get("weights_uri")
        if not uri:
            raise AdapterLoadError(adapter_id, "store_error", "the registry has no weights_uri for it")
        return uri

    async def fetch(self, adapter_id: str, dest: Path) -> Path:
        if self.store is None:
            await self.client.download_archive(adapter_id, dest)
            return dest
        return await self.fetch_uri(adapter_id, await self._weights_uri(adapter_id), dest)

    async def open_stream(self, adapter_id: str):
        """The archive's bytes as they download from a remote store; None without a store (the
        registry's download lands in a file) or for a local folder (read in place)."""
        if self.store is None:
            return None
        return self.stream_uri(adapter_id, await self._weights_uri(adapter_id))

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()
        if self.store is not None:
            await self.store.close()
