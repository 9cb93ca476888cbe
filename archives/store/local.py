"""`file:///abs/dir`: the object store as a local folder (the embedded default).

Objects are plain files under the root; `put_file` copies to a hidden temp file in the target
folder, fsyncs and renames, so a reader (or a crash) never sees a partial archive. Blocking file
work runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from archives.errors import ObjectNotFoundError, StoreError
from archives.fsutil import atomic_copy
from archives.store.base import ObjectStore, check_key, check_prefix, is_valid_key


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike):
        root = Path(root)
        if not root.is_absolute():
            raise StoreError(f"local store folder must be an absolute path, got {str(root)!r}")
        self.root = Path(os.path.normpath(root))
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"local store {self.root} exists and is not a folder")

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def local_path(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.is_file() else None

    def _put(self, key: str, src: Path) -> None:
        dest = self._path(key)
        try:
            f = open(src, "rb")
        except OSError as e:
            raise StoreError(f"cannot read {src}: {e.strerror or e}") from None
        try:
            with f:
                atomic_copy(f, dest)
        except OSError as e:
            raise StoreError(f"cannot write {self.uri_for(key)}: {e.strerror or e}") from None

    def _get(self, key: str, dest: Path) -> None:
        src = self._path(key)
        try:
            f = open(src, "rb")
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri_for(key)} does not exist") from None
        except OSError as e:
            raise StoreError(f"cannot read {self.uri_for(key)}: {e.strerror or e}") from None
        try:
            with f:
                atomic_copy(f, dest)
        except OSError as e:
            raise StoreError(f"cannot write {dest}: {e.strerror or e}") from None

    def _list(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        # Walk only below the folder part of the prefix.
        start = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        keys = []
        for folder, dirs, files in os.walk(start):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = Path(folder).relative_to(self.root).as_posix()
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix) and is_valid_key(key):
                    keys.append(key)
        return sorted(keys)

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreError(f"cannot delete {self.uri_for(key)}: {e.strerror or e}") from None

    async def put_file(self, key: str, path: str | os.PathLike) -> None:
        check_key(key)
        await asyncio.to_thread(self._put, key, Path(path))

    async def get_file(self, key: str, path: str | os.PathLike) -> None:
        check_key(key)
        await asyncio.to_thread(self._get, key, Path(path))

    async def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    async def delete(self, key: str) -> None:
        check_key(key)
        await asyncio.to_thread(self._delete, key)

    async def list(self, prefix: str = "") -> list[str]:
        return await asyncio.to_thread(self._list, prefix)

    def uri_for(self, key: str) -> str:
        return self._path(key).as_uri()

    def key_for(self, uri: str) -> str | None:
        try:
            parsed = urlparse(uri)
        except (TypeError, ValueError):
            return None
        if (
            parsed.scheme != "file"
            or parsed.netloc not in ("", "localhost")
            or parsed.query
            or parsed.fragment
        ):
            return None
        path = unquote(parsed.path)
        root = self.root.as_posix().rstrip("/") + "/"
        if not path.startswith(root):
            return None
        key = path[len(root) :]
        return key if is_valid_key(key) else None
