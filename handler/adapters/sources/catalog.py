"""A standalone adapter source: a fixed catalog of adapter ids and their archive URIs in the store."""

from __future__ import annotations

import json
from pathlib import Path

from handler.adapters.errors import AdapterNotFoundError
from handler.adapters.sources.store import StoreFetch


class CatalogSource(StoreFetch):
    """Standalone source (no registry): a fixed catalog `{adapter_id: weights_uri}` into the store.
    `load(path)` reads it from a JSON file (an object, or `{"adapters": [{adapter_id, weights_uri}]}`)."""

    def __init__(self, catalog: dict[str, str], store):
        super().__init__(store)
        self.catalog = dict(catalog)

    @classmethod
    def load(cls, path: str | Path, store) -> CatalogSource:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and isinstance(data.get("adapters"), list):
            data = {a["adapter_id"]: a["weights_uri"] for a in data["adapters"]}
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"{path}: expected {{adapter_id: weights_uri}}")
        return cls(data, store)

    async def exists(self, adapter_id: str) -> bool:
        return adapter_id in self.catalog

    async def fetch(self, adapter_id: str, dest: Path) -> Path:
        if adapter_id not in self.catalog:
            raise AdapterNotFoundError(adapter_id)
        return await self.fetch_uri(adapter_id, self.catalog[adapter_id], dest)

    async def open_stream(self, adapter_id: str):
        if adapter_id not in self.catalog:
            raise AdapterNotFoundError(adapter_id)
        return self.stream_uri(adapter_id, self.catalog[adapter_id])

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
