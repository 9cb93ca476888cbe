"""Object store for archives: `file:///abs/dir` (local folder) or `s3://bucket/prefix`.

store = open_store(os.environ.get("LORAFARM_STORE_URL"), endpoint_url=...)
await store.put_file("adapters/acme/ad-....lar", path)
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from archives.errors import StoreError
from archives.store.base import ObjectStore, check_key
from archives.store.local import LocalStore
from archives.store.s3 import S3Store

__all__ = ["ObjectStore", "LocalStore", "S3Store", "open_store", "check_key"]


def open_store(url: str, *, endpoint_url: str | None = None, **options) -> ObjectStore:
    """The store at `url`: `file:///abs/dir`, a plain absolute path, or `s3://bucket[/prefix]`.

    For S3, `endpoint_url` selects an S3-compatible server (default: $LORAFARM_S3_ENDPOINT_URL,
    else AWS); `options` go to S3Store (attempts, backoff_s, region_name, timeouts). Opening
    makes no network call. Raises StoreError for an unsupported or malformed URL.
    """
    if not isinstance(url, str) or not url:
        raise StoreError("no object store URL given (file:///abs/dir or s3://bucket/prefix)")
    if url.startswith("/"):
        return LocalStore(Path(url))
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"file store URL {url!r} must be absolute: file:///abs/dir")
        return LocalStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreError(f"S3 store URL {url!r} has no bucket (s3://bucket/prefix)")
        endpoint = endpoint_url or os.environ.get("LORAFARM_S3_ENDPOINT_URL") or None
        return S3Store(parsed.netloc, parsed.path, endpoint_url=endpoint, **options)
    raise StoreError(f"unsupported object store URL {url!r} (use file:///abs/dir or s3://bucket/prefix)")
