"""The object-store interface shared by the local-folder and S3 backends.

Keys are relative, `/`-separated names (`adapters/acme/ad-....lar`). Each segment uses
`[A-Za-z0-9._=+@-]` and may not start with a dot, so a key can never be `..`, absolute, or
collide with a backend's hidden temp files.
"""

from __future__ import annotations

import abc
import os
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from archives.errors import StoreError

MAX_KEY_LENGTH = 1024
_SEGMENT = r"[A-Za-z0-9_=+@-][A-Za-z0-9._=+@-]*"
KEY_RE = re.compile(rf"^{_SEGMENT}(?:/{_SEGMENT})*$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._=+@/-]*$")


def check_key(key: str) -> str:
    """Return `key` if it is a valid store key, else raise StoreError."""
    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH or not KEY_RE.match(key):
        raise StoreError(
            f"invalid object key {key!r}: use relative '/'-separated names of [A-Za-z0-9._=+@-] "
            f"whose parts do not start with '.'"
        )
    return key


def is_valid_key(key: str) -> bool:
    return isinstance(key, str) and len(key) <= MAX_KEY_LENGTH and bool(KEY_RE.match(key))


def check_prefix(prefix: str) -> str:
    """A listing prefix: a plain string prefix of keys (may end mid-segment), no `..` parts."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix) or ".." in prefix.split("/"):
        raise StoreError(f"invalid listing prefix {prefix!r}")
    return prefix


class ObjectStore(abc.ABC):
    """Async object store. Every method raises StoreError (ObjectNotFoundError for a missing key).

    Use `async with store:` or call `await store.close()` when done.
    """

    @abc.abstractmethod
    async def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Store the file at `path` under `key`, replacing any previous object (readers never
        see a partial object)."""

    @abc.abstractmethod
    async def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Stream the object to `path` (written to a temp file beside it, then renamed)."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error (idempotent, as in S3)."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with `prefix` (a string prefix, as in S3)."""

    @abc.abstractmethod
    def uri_for(self, key: str) -> str:
        """The URI of `key` in this store: `file:///abs/dir/key` or `s3://bucket/prefix/key`."""

    @abc.abstractmethod
    def key_for(self, uri: str) -> str | None:
        """The key of `uri` when it lies inside this store, else None (the registry refuses
        weights_uri values outside its store with this)."""

    def local_path(self, key: str) -> Path | None:
        """The object's own file when this store is a local folder (read it in place, no copy);
        None for a remote store."""
        return None

    def open_stream(self, key: str) -> AsyncIterator[bytes] | None:
        """The object's bytes, chunk by chunk as they download (to verify and extract an archive
        while it arrives, see archives/store/pipe.py); None when the store has no such stream
        (a local folder is read in place through `local_path`)."""
        return None

    async def close(self) -> None:
        """Release connections; the store can not be used afterwards."""
        return None  # nothing to release by default

    async def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` under `key` (convenience over put_file for small objects)."""
        fd, tmp = tempfile.mkstemp(prefix=".lorafarm-put.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            await self.put_file(key, tmp)
        finally:
            Path(tmp).unlink(missing_ok=True)

    async def get_bytes(self, key: str) -> bytes:
        """The whole object in memory (for small objects; use get_file for archives)."""
        fd, tmp = tempfile.mkstemp(prefix=".lorafarm-get.", suffix=".tmp")
        os.close(fd)
        try:
            await self.get_file(key, tmp)
            return Path(tmp).read_bytes()
        finally:
            Path(tmp).unlink(missing_ok=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
