"""Fetch an adapter's signed archive from the configured object store (local folder or S3)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from archives.errors import StoreError


class StoreFetch:
    """Fetch a `weights_uri` from the configured object store; a URI outside the store is refused."""

    def __init__(self, store):
        self.store = store

    def _key(self, adapter_id: str, uri: str) -> str:
        key = self.store.key_for(uri)
        if key is None:
            raise StoreError(f"weights_uri {uri!r} of {adapter_id} lies outside the configured object store")
        return key

    def _local(self, key: str) -> Path | None:
        """The store's own file for `key` when the store is a local folder, else None."""
        return self.store.local_path(key) if hasattr(self.store, "local_path") else None

    async def fetch_uri(self, adapter_id: str, uri: str, dest: Path) -> Path:
        """The archive's path: the store's own file when the store is a local folder (read in place,
        no second full copy; the cache verifies what it reads), else `dest` after a download."""
        key = self._key(adapter_id, uri)
        local = self._local(key)
        if local is not None:
            return local
        await self.store.get_file(key, dest)
        return dest

    def stream_uri(self, adapter_id: str, uri: str) -> AsyncIterator[bytes] | None:
        """The archive's bytes as they download from a remote store (the cache verifies and extracts
        them on the way, no archive file); None for a local folder (read in place by `fetch_uri`)."""
        key = self._key(adapter_id, uri)
        if self._local(key) is not None:
            return None
        open_stream = getattr(self.store, "open_stream", None)
        return open_stream(key) if open_stream is not None else None
