"""Fetch an adapter's signed archive from the configured object store (local folder or S3)."""

from __future__ import annotations

from pathlib import Path


class StoreFetch:
    """Fetch a `weights_uri` from the configured object store; a URI outside the store is refused."""

    def __init__(self, store):
        self.store = store

    async def fetch_uri(self, adapter_id: str, uri: str, dest: Path) -> None:
        from archives.errors import StoreError

        key = self.store.key_for(uri)
        if key is None:
            raise StoreError(f"weights_uri {uri!r} of {adapter_id} lies outside the configured object store")
        await self.store.get_file(key, dest)
