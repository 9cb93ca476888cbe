"""Where a replica's cold adapters come from (the `remote` tier): one module per source.

- `registry.RegistrySource`: production; metadata from the registry, bytes from the object store.
- `catalog.CatalogSource`: standalone; a fixed `{adapter_id: weights_uri}` catalog into the store.
- `store.StoreFetch`: fetch a `weights_uri` from the configured object store to a local file, or
  stream it from a remote (S3) store.
- `NoSource`: only adapters already on local disk are served.

A source writes the signed archive; the cache verifies it before a byte of it is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from handler.adapters.errors import AdapterNotFoundError


class AdapterSource(Protocol):
    """Where cold adapters come from (the `remote` tier)."""

    async def exists(self, adapter_id: str) -> bool: ...

    async def fetch(self, adapter_id: str, dest: Path) -> Path | None:
        """Make the adapter's signed archive readable: write it to `dest`, or return the path of a
        local file that already holds it (unverified either way: the cache verifies it)."""

    async def close(self) -> None: ...

    # Optional: `async def open_stream(self, adapter_id) -> AsyncIterator[bytes] | None`, the archive's
    # bytes as they download from a remote store (the cache verifies and extracts them on the way);
    # None (or no such method) means `fetch`.


class NoSource:
    """No registry and no catalog: only adapters already on local disk are served."""

    async def exists(self, adapter_id: str) -> bool:
        return False

    async def fetch(self, adapter_id: str, dest: Path) -> Path | None:
        raise AdapterNotFoundError(adapter_id)

    async def close(self) -> None:
        pass


from handler.adapters.sources.catalog import CatalogSource  # noqa: E402
from handler.adapters.sources.registry import RegistrySource  # noqa: E402
from handler.adapters.sources.store import StoreFetch  # noqa: E402

__all__ = ["AdapterSource", "CatalogSource", "NoSource", "RegistrySource", "StoreFetch"]
