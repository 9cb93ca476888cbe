"""`s3://bucket/prefix`: the object store on S3 or any S3-compatible server, through aioboto3.

One client per store, created on first use (and again if the event loop changed). Every call is
retried on transient failures (connection errors, timeouts, 5xx, throttling) with exponential
backoff and jitter; botocore's own retries are off so the policy is ours alone. Every failure
surfaces as StoreError, a missing key as ObjectNotFoundError.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from archives.digest import BLOCK
from archives.errors import ObjectNotFoundError, StoreError
from archives.fsutil import fsync_dir
from archives.store.base import ObjectStore, check_key, check_prefix, is_valid_key

T = TypeVar("T")
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "RequestTimeTooSkewed"}  # fmt: skip


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        attempts: int = 4,
        backoff_s: float = 0.25,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
    ):
        if not BUCKET_RE.match(bucket):
            raise StoreError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket, self.prefix = bucket, prefix
        self.endpoint_url = endpoint_url
        self.region_name = (
            region_name or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        )
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._client = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"S3Store({self.uri_for_prefix()!r}, endpoint_url={self.endpoint_url!r})"

    def uri_for_prefix(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _object_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    async def _get_client(self):
        loop = asyncio.get_running_loop()
        if self._client is not None and self._loop is loop:
            return self._client
        if self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:  # concurrent first calls share one client
            if self._client is None or self._loop is not loop:
                await self._make_client(loop)
        return self._client

    async def _make_client(self, loop: asyncio.AbstractEventLoop) -> None:
        # A client is bound to the loop it was made on; a new loop (e.g. a second asyncio.run
        # in a CLI) needs a new one (the old one cannot be closed from here and is dropped).
        import aioboto3
        from botocore.config import Config

        stack = contextlib.AsyncExitStack()
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # no hidden retries: see _call
            connect_timeout=self._timeouts[0],
            read_timeout=self._timeouts[1],
            s3={"addressing_style": "path"} if self.endpoint_url else None,
        )
        self._client = await stack.enter_async_context(
            aioboto3.Session().client(
                "s3", endpoint_url=self.endpoint_url, region_name=self.region_name, config=config
            )
        )
        self._stack, self._loop = stack, loop

    async def close(self) -> None:
        stack, self._stack, self._client, self._loop = self._stack, None, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                await stack.aclose()

    # -- errors and retries -----------------------------------------------------------------
    @staticmethod
    def _is_transient(e: BaseException) -> bool:
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return err.get("Code") in _TRANSIENT_CODES or status >= 500
        transient = (EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError, ReadTimeoutError,
                     ResponseStreamingError, asyncio.TimeoutError, ConnectionError)  # fmt: skip
        try:
            import aiohttp

            transient += (aiohttp.ClientError,)
        except ImportError:  # pragma: no cover - aiobotocore depends on aiohttp
            pass
        return isinstance(e, transient)

    def _as_store_error(self, e: BaseException, what: str, key: str | None) -> StoreError:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = self.uri_for(key) if key is not None else self.uri_for_prefix()
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in _NOT_FOUND:
                return ObjectNotFoundError(f"{where} does not exist")
            if code == "NoSuchBucket":
                return StoreError(f"S3 bucket {self.bucket!r} does not exist")
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return StoreError(f"S3 {what} {where}: access denied ({code})")
            return StoreError(
                f"S3 {what} {where} failed: {code or 'error'} {err.get('Message', '')}".rstrip()
            )
        if isinstance(e, NoCredentialsError):
            return StoreError(f"S3 {what} {where}: no AWS credentials configured")
        if isinstance(e, BotoCoreError | asyncio.TimeoutError | ConnectionError):
            return StoreError(f"S3 {what} {where} failed: {e or type(e).__name__}")
        return StoreError(f"S3 {what} {where} failed: {type(e).__name__}: {e}")

    async def _call(self, what: str, key: str | None, fn: Callable[[object], Awaitable[T]]) -> T:
        """Run `fn(client)` with retries on transient errors; map failures to StoreError."""
        from botocore.exceptions import BotoCoreError, ClientError

        for attempt in range(self.attempts):
            try:
                return await fn(await self._get_client())
            except (ClientError, BotoCoreError, asyncio.TimeoutError, ConnectionError, OSError) as e:
                if isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in _NOT_FOUND:
                    raise self._as_store_error(e, what, key) from None
                if attempt + 1 < self.attempts and self._is_transient(e):
                    await asyncio.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
                    continue
                raise self._as_store_error(e, what, key) from None
            except Exception as e:  # aiohttp errors and anything else from the HTTP stack
                if attempt + 1 < self.attempts and self._is_transient(e):
                    await asyncio.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
                    continue
                raise self._as_store_error(e, what, key) from None
        raise AssertionError("unreachable")

    # -- operations -------------------------------------------------------------------------
    async def put_file(self, key: str, path: str | os.PathLike) -> None:
        obj = self._object_key(key)
        path = Path(path)
        if not path.is_file():
            raise StoreError(f"cannot read {path}: not a file")
        # upload_file switches to multipart for large files; S3 makes the object visible only
        # when the upload completes, so readers never see a partial archive.
        await self._call("put", key, lambda c: c.upload_file(str(path), self.bucket, obj))

    async def get_file(self, key: str, path: str | os.PathLike) -> None:
        obj = self._object_key(key)
        dest = Path(path)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot write {dest}: {e.strerror or e}") from None

        async def download(client) -> None:
            resp = await client.get_object(Bucket=self.bucket, Key=obj)
            expected = resp.get("ContentLength")
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    body = resp["Body"]
                    try:
                        while chunk := await body.read(BLOCK):
                            out.write(chunk)
                    finally:
                        body.close()
                    if expected is not None and out.tell() != expected:
                        raise ConnectionError(f"download ended after {out.tell()} of {expected} bytes")
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            fsync_dir(dest.parent)

        await self._call("get", key, download)

    def open_stream(self, key: str) -> AsyncIterator[bytes]:
        return self.iter_chunks(key)

    async def iter_chunks(self, key: str, chunk_size: int = BLOCK) -> AsyncIterator[bytes]:
        """The object's bytes in chunks of at most `chunk_size` as they download. Opening the object
        is retried like every call; a failure in the body is not (its bytes were handed out already):
        it raises StoreError, and so does a body shorter than its ContentLength (a truncated
        download never looks like a complete object)."""
        obj = self._object_key(key)
        resp = await self._call("get", key, lambda c: c.get_object(Bucket=self.bucket, Key=obj))
        expected, got = resp.get("ContentLength"), 0
        body = resp["Body"]
        try:
            while True:
                try:
                    chunk = await body.read(chunk_size)
                except Exception as e:  # botocore / aiohttp errors of the body stream
                    raise self._as_store_error(e, "get", key) from None
                if not chunk:
                    break
                got += len(chunk)
                yield chunk
        finally:
            body.close()
        if expected is not None and got != expected:
            raise StoreError(
                f"S3 get {self.uri_for(key)}: truncated, the download ended after {got} of {expected} bytes"
            )

    async def exists(self, key: str) -> bool:
        obj = self._object_key(key)
        try:
            await self._call("head", key, lambda c: c.head_object(Bucket=self.bucket, Key=obj))
        except ObjectNotFoundError:
            return False
        return True

    async def delete(self, key: str) -> None:
        obj = self._object_key(key)
        await self._call("delete", key, lambda c: c.delete_object(Bucket=self.bucket, Key=obj))

    async def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""

        async def collect(client) -> list[str]:
            keys = []
            async for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            ):
                for item in page.get("Contents", []):
                    key = item["Key"][len(base) :]
                    if is_valid_key(key):
                        keys.append(key)
            return sorted(keys)

        return await self._call("list", None, collect)

    def uri_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._object_key(key)}"

    def key_for(self, uri: str) -> str | None:
        try:
            parsed = urlparse(uri)
        except (TypeError, ValueError):
            return None
        if parsed.scheme != "s3" or parsed.netloc != self.bucket or parsed.query or parsed.fragment:
            return None
        path = parsed.path.lstrip("/")
        if self.prefix:
            if not path.startswith(self.prefix + "/"):
                return None
            path = path[len(self.prefix) + 1 :]
        return path if is_valid_key(path) else None
