"""Property: whatever bytes the archive reader gets, it returns the signed manifest or raises an
ArchiveError subclass, never anything else, and a failed extraction leaves nothing behind."""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from archives.errors import ArchiveError
from archives.extract import extract_archive
from archives.verify import read_manifest, verify_archive

SETTINGS = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _check(data: bytes, keys, original=None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.lar"
        path.write_bytes(data)
        try:
            manifest = verify_archive(path, [keys.public])
        except ArchiveError:
            manifest = None
        if manifest is not None:  # only edits in padding can leave an archive valid
            assert original is not None and manifest == original
        try:
            read_manifest(path)
        except ArchiveError:
            pass
        dest = Path(tmp) / "out"
        try:
            assert extract_archive(path, dest, [keys.public]) == manifest
        except ArchiveError:
            assert manifest is None
            assert not dest.exists()


@SETTINGS
@given(data=st.binary(max_size=4096))
def test_random_bytes(data, keys):
    _check(data, keys)


@SETTINGS
@given(blocks=st.lists(st.binary(min_size=512, max_size=512), min_size=1, max_size=6))
def test_random_tar_sized_blocks(blocks, keys):
    _check(b"".join(blocks) + b"\0" * 1024, keys)


def _mutations(original: bytes, hot: list[int]):
    """Byte edits, biased to tar headers and the manifest/signature region where parsers branch."""
    position = st.one_of(
        st.integers(0, len(original) - 1),
        st.builds(
            lambda base, off: min(base + off, len(original) - 1), st.sampled_from(hot), st.integers(0, 511)
        ),
    )
    flip = st.tuples(st.just("set"), position, st.integers(0, 255))
    cut = st.tuples(st.just("cut"), position, st.just(0))
    insert = st.tuples(st.just("insert"), position, st.integers(0, 255))
    return st.lists(st.one_of(flip, flip, cut, insert), min_size=1, max_size=4)


def _apply(original: bytes, edits) -> bytes:
    data = bytearray(original)
    for op, pos, value in edits:
        pos = min(pos, max(len(data) - 1, 0))
        if not data:
            break
        if op == "set":
            data[pos] = value
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos] = bytes([value])
    return bytes(data)


@SETTINGS
@given(st.data())
def test_mutated_archives(good_archive, keys, data):
    original = good_archive.read_bytes()
    with tarfile.open(good_archive) as tar:
        hot = [m.offset for m in tar.getmembers()] + [m.offset_data for m in tar.getmembers()][:3]
    edits = data.draw(_mutations(original, hot))
    _check(_apply(original, edits), keys, verify_archive(good_archive, [keys.public]))
