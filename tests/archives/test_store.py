"""The object store, both backends through the same tests: local folder and S3 (moto server)."""

from __future__ import annotations

import asyncio
import http.server
import os
import threading
from pathlib import Path

import pytest

from archives.errors import ObjectNotFoundError, StoreError
from archives.store import LocalStore, S3Store, open_store


@pytest.fixture(params=["file", "s3"])
async def store(request, tmp_path):
    if request.param == "file":
        s = open_store(f"file://{tmp_path / 'store'}")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        s = open_store(f"s3://{bucket}/farm/adapters", endpoint_url=endpoint)
    yield s
    await s.close()


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


async def test_put_get_exists_list_delete(store, tmp_path):
    data = os.urandom(300_000)
    await store.put_file("acme/ad-1.lar", _file(tmp_path, "src", data))
    await store.put_file("acme/ad-2.lar", _file(tmp_path, "src2", b"two"))
    await store.put_file("zeta/ad-3.lar", _file(tmp_path, "src3", b"three"))

    assert await store.exists("acme/ad-1.lar")
    assert not await store.exists("acme/ad-9.lar")
    assert await store.list() == ["acme/ad-1.lar", "acme/ad-2.lar", "zeta/ad-3.lar"]
    assert await store.list("acme/") == ["acme/ad-1.lar", "acme/ad-2.lar"]
    assert await store.list("acme/ad-2") == ["acme/ad-2.lar"]
    assert await store.list("nobody/") == []

    out = tmp_path / "fetched" / "deep" / "a.lar"
    await store.get_file("acme/ad-1.lar", out)
    assert out.read_bytes() == data
    assert sorted(os.listdir(out.parent)) == ["a.lar"]  # no temp files left beside it

    await store.delete("acme/ad-1.lar")
    assert not await store.exists("acme/ad-1.lar")
    await store.delete("acme/ad-1.lar")  # idempotent
    assert await store.list() == ["acme/ad-2.lar", "zeta/ad-3.lar"]


async def test_put_replaces(store, tmp_path):
    await store.put_file("k.lar", _file(tmp_path, "a", b"old"))
    await store.put_file("k.lar", _file(tmp_path, "b", b"new bytes"))
    assert await store.get_bytes("k.lar") == b"new bytes"


async def test_bytes_helpers(store):
    await store.put_bytes("small/obj", b"\x00\x01hello")
    assert await store.get_bytes("small/obj") == b"\x00\x01hello"


async def test_missing_object(store, tmp_path):
    with pytest.raises(ObjectNotFoundError, match="does not exist"):
        await store.get_file("acme/none.lar", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "key", ["", "/abs", "../x", "a/../b", "a//b", ".hidden", "a/.tmp", "a b", "a\\b", "a/"]
)
async def test_invalid_keys(store, tmp_path, key):
    with pytest.raises(StoreError, match="invalid object key"):
        await store.put_file(key, _file(tmp_path, "src", b"x"))
    with pytest.raises(StoreError, match="invalid object key"):
        store.uri_for(key)


async def test_uri_and_key_roundtrip(store):
    uri = store.uri_for("acme/ad-1.lar")
    assert store.key_for(uri) == "acme/ad-1.lar"
    assert uri.endswith("/acme/ad-1.lar")


def test_uris_local(tmp_path):
    s = open_store(f"file://{tmp_path}/store")
    assert s.uri_for("a/b.lar") == f"file://{tmp_path}/store/a/b.lar"
    assert s.key_for(f"file://{tmp_path}/store/a/b.lar") == "a/b.lar"
    assert s.key_for(f"file://localhost{tmp_path}/store/a/b.lar") == "a/b.lar"
    for outside in [
        f"file://{tmp_path}/other/a.lar",
        f"file://{tmp_path}/store",
        f"file://{tmp_path}/storex/a.lar",  # a sibling whose name starts like the root
        f"file://{tmp_path}/store/../other/a.lar",
        f"file://{tmp_path}/store/a/../../x",
        f"file://evil.example{tmp_path}/store/a.lar",
        f"s3://bucket{tmp_path}/store/a.lar",
        "http://example.com/a.lar",
        "/etc/passwd",
        "",
    ]:
        assert s.key_for(outside) is None, outside


def test_uris_s3():
    s = open_store("s3://bucket/pre/fix/", endpoint_url="http://127.0.0.1:9")
    assert isinstance(s, S3Store)
    assert s.uri_for("a/b.lar") == "s3://bucket/pre/fix/a/b.lar"
    assert s.key_for("s3://bucket/pre/fix/a/b.lar") == "a/b.lar"
    for outside in ["s3://bucket/pre/a.lar", "s3://other/pre/fix/a.lar", "s3://bucket/pre/fixx/a.lar",
                    "s3://bucket/pre/fix/../../a.lar", "file:///pre/fix/a.lar", "s3://bucket/pre/fix/"]:  # fmt: skip
        assert s.key_for(outside) is None, outside
    bare = open_store("s3://bucket")
    assert bare.uri_for("k") == "s3://bucket/k" and bare.key_for("s3://bucket/k") == "k"


def test_open_store_urls(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path
    for bad, words in [
        ("file://relative/dir", "must be absolute"),
        ("http://x/y", "unsupported"),
        ("", "no object store URL"),
        ("s3://", "no bucket"),
        ("s3://Bad_Bucket/x", "invalid S3 bucket"),
    ]:
        with pytest.raises(StoreError, match=words):
            open_store(bad)


async def test_local_put_is_atomic_and_clean(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    await store.put_file("a/b/c.lar", _file(tmp_path, "src", b"abc"))
    assert sorted(p.name for p in (tmp_path / "store" / "a" / "b").iterdir()) == ["c.lar"]
    # a leftover temp file of a crashed put is not an object
    (tmp_path / "store" / "a" / ".c.lar.x.tmp").write_bytes(b"partial")
    assert await store.list() == ["a/b/c.lar"]


async def test_local_put_missing_source(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    with pytest.raises(StoreError, match="cannot read"):
        await store.put_file("k", tmp_path / "missing")


async def test_s3_missing_bucket(s3_endpoint):
    async with open_store("s3://no-such-bucket-here", endpoint_url=s3_endpoint) as s:
        with pytest.raises(StoreError, match="does not exist"):
            await s.list()


async def test_s3_unreachable_endpoint_retries_then_fails(s3_endpoint, tmp_path):  # s3_endpoint: credentials
    # port 9 (discard) on loopback: nothing listens, connections are refused at once
    async with open_store(
        "s3://bucket/x", endpoint_url="http://127.0.0.1:9", attempts=3, backoff_s=0.01
    ) as s:
        with pytest.raises(StoreError, match="Could not connect"):
            await s.exists("k")
        with pytest.raises(StoreError, match="Could not connect"):
            await s.get_file("k", tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _FlakyS3(threading.Thread):
    """A tiny HTTP server that answers `failures` requests with 503 SlowDown, then 200: a real
    network peer for the retry path (moto cannot be told to fail)."""

    def __init__(self, failures: int, body: bytes = b""):
        super().__init__(daemon=True)
        outer = self
        self.failures, self.requests, self.body = failures, 0, body

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):
                outer.requests += 1
                ok = outer.requests > outer.failures
                self.send_response(200 if ok else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):  # promises twice the body it sends, then hangs up: a truncated download
                outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(2 * len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def run(self):
        self.server.serve_forever()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("attempts, succeeds", [(3, True), (2, False)])
async def test_s3_retries_transient_errors(s3_endpoint, attempts, succeeds):
    server = _FlakyS3(failures=2)
    server.start()
    try:
        async with open_store("s3://bucket", endpoint_url=server.url, attempts=attempts, backoff_s=0.01) as s:
            if succeeds:
                assert await s.exists("k")
            else:
                with pytest.raises(StoreError, match="503|ServiceUnavailable|failed"):
                    await s.exists("k")
        assert server.requests == min(attempts, 3)
    finally:
        server.stop()


def test_s3_store_survives_a_new_event_loop(s3_endpoint, s3_bucket, tmp_path):
    """A CLI may call asyncio.run more than once with one store: each loop gets its own client."""
    store = open_store(f"s3://{s3_bucket}", endpoint_url=s3_endpoint)
    asyncio.run(store.put_file("k", _file(tmp_path, "src", b"data")))
    assert asyncio.run(store.get_bytes("k")) == b"data"
    asyncio.run(store.close())


async def test_s3_concurrent_first_calls(s3_endpoint, s3_bucket, tmp_path):
    async with open_store(f"s3://{s3_bucket}", endpoint_url=s3_endpoint) as store:
        await asyncio.gather(*(store.put_bytes(f"k{i}", bytes([i])) for i in range(6)))
        assert await store.list() == [f"k{i}" for i in range(6)]
        assert await asyncio.gather(*(store.get_bytes(f"k{i}") for i in range(6))) == [
            bytes([i]) for i in range(6)
        ]


async def test_open_stream(store):
    """S3 streams an object chunk by chunk as it downloads; a local folder has no stream (its file is
    read in place)."""
    from archives.digest import BLOCK

    data = os.urandom(2 * BLOCK + 17)
    await store.put_bytes("a/big.lar", data)
    chunks = store.open_stream("a/big.lar")
    if isinstance(store, LocalStore):
        assert chunks is None and store.local_path("a/big.lar").read_bytes() == data
        return
    got = [c async for c in chunks]
    assert b"".join(got) == data and max(map(len, got)) <= BLOCK
    with pytest.raises(ObjectNotFoundError):
        async for _ in store.open_stream("a/missing.lar"):
            pass


async def test_s3_truncated_stream_is_an_error(s3_endpoint):  # s3_endpoint: credentials
    """A body shorter than its Content-Length raises StoreError: it never ends like a whole object."""
    server = _FlakyS3(failures=0, body=b"x" * 5000)
    server.start()
    try:
        async with open_store("s3://bucket", endpoint_url=server.url, attempts=1) as s:
            got = bytearray()
            with pytest.raises(StoreError, match="not completed|truncated"):
                async for chunk in s.open_stream("k.lar"):
                    got += chunk
            assert len(got) <= 5000
    finally:
        server.stop()
