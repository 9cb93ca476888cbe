"""Verify + extract while the archive streams in (archives/stream.py): the same result as the file
path for a good archive, the same refusals for every attack, the signature checked before a payload
byte is read, nothing left behind on failure; and the pipe that feeds it from an async download."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import pytest

from archives.errors import (
    ArchiveError,
    BaseMismatchError,
    ChecksumError,
    CorruptArchiveError,
    RankLimitError,
    SignatureError,
    StoreError,
    UnsafeArchiveError,
)
from archives.extract import extract_archive_one_pass
from archives.manifest import MEMBER_NAMES
from archives.store.pipe import ChunkPipe
from archives.stream import extract_archive_stream
from archives.verify import verify_archive
from tests.archives.tarcraft import Member, get, read_members, write_tar
from tests.archives.test_attacks import ATTACKS, _edit_manifest_after_signing, _flip_weight_byte

# The stream meets members in order, so a bad header after a good one shows up as that one's
# fault: the hard link to manifest.json stands where the weights come first.
STREAM_WORDS = {"hardlink member": "out of order"}


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _stream(path: Path) -> io.BufferedReader:
    """A plain, forward-only reader of the archive (as a download is)."""
    return io.BufferedReader(io.FileIO(path, "rb"))


class _Cut(Exception):
    pass


class _StopAfter(io.RawIOBase):
    """Serves the first `limit` bytes of `data`; reading past them raises _Cut."""

    def __init__(self, data: bytes, limit: int):
        self.data, self.limit, self.pos = data, limit, 0

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.limit:
            raise _Cut(f"read past byte {self.limit}")
        end = self.limit if n < 0 else min(self.limit, self.pos + n)
        out, self.pos = self.data[self.pos : end], end
        return out


def _end_of_signature(path: Path) -> int:
    with tarfile.open(path) as tar:
        m = tar.getmember("manifest.sig")
    return m.offset_data + 512  # the signature's data block, padded


def test_stream_extraction_equals_file_extraction(good_archive, keys, base_hash, base_config, tmp_path):
    checks = {"base_model_hash": base_hash, "max_rank": 64, "base_config": base_config}
    by_file = extract_archive_one_pass(good_archive, tmp_path / "file", [keys.public], **checks)
    with _stream(good_archive) as f:
        by_stream = extract_archive_stream(f, tmp_path / "stream", [keys.public], **checks)
    assert by_stream == by_file
    assert _tree(tmp_path / "stream") == _tree(tmp_path / "file")
    assert sorted(_tree(tmp_path / "stream")) == sorted(MEMBER_NAMES)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_stream_refuses_every_attack_and_writes_nothing(attack, good_archive, keys, other_keys, tmp_path):
    make, error, words = ATTACKS[attack]
    evil = write_tar(tmp_path / "evil.lar", make(read_members(good_archive), keys, other_keys, tmp_path))
    dest = tmp_path / "work" / "out"
    with _stream(evil) as f, pytest.raises(error, match=STREAM_WORDS.get(attack, words)):
        extract_archive_stream(f, dest, [keys.public])
    assert not dest.exists()  # (its parent may have been made: as on the file path)
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


def test_signature_is_checked_before_a_payload_byte_is_read(good_archive, keys, tmp_path):
    """Cut the stream right after manifest.sig: a bad signature is refused as such (the payload was
    never needed), a good one goes on to read the payload (and meets the cut)."""
    members = read_members(good_archive)
    bad = write_tar(tmp_path / "bad.lar", _edit_manifest_after_signing(members, keys, None, tmp_path))
    good = write_tar(tmp_path / "good.lar", members)
    dest = tmp_path / "out"
    with pytest.raises(SignatureError, match="trusted key"):
        extract_archive_stream(_StopAfter(bad.read_bytes(), _end_of_signature(bad)), dest, [keys.public])
    assert not dest.exists()
    with pytest.raises(_Cut):
        extract_archive_stream(_StopAfter(good.read_bytes(), _end_of_signature(good)), dest, [keys.public])
    assert not dest.exists()


def test_tampered_payload_leaves_an_existing_folder_as_it_was(good_archive, keys, tmp_path):
    members = _flip_weight_byte(read_members(good_archive), keys, None, tmp_path)
    evil = write_tar(tmp_path / "evil.lar", members)
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with _stream(evil) as f, pytest.raises(ChecksumError, match="sha256"):
        extract_archive_stream(f, dest, [keys.public])
    assert _tree(dest) == {"keep.txt": b"mine"}


@pytest.mark.parametrize("keep", [0, 100, 1536, 4000, -600, -2000])
def test_truncated_stream(good_archive, keys, tmp_path, keep):
    """Cut anywhere, also inside the weights (negative: bytes off the end, past the zero blocks)."""
    data = good_archive.read_bytes()
    with tarfile.open(good_archive) as tar:
        weights = tar.getmember("adapter_model.safetensors")
    end_of_weights = weights.offset_data + weights.size
    cut = keep if keep >= 0 else end_of_weights + keep
    with pytest.raises(ArchiveError) as info:
        extract_archive_stream(io.BytesIO(data[:cut]), tmp_path / "out", [keys.public])
    if cut > weights.offset_data:
        assert isinstance(info.value, CorruptArchiveError) and "truncated" in str(info.value)
    else:
        assert isinstance(info.value, CorruptArchiveError | SignatureError)
    assert not (tmp_path / "out").exists()


def test_members_out_of_order_are_refused(good_archive, keys, tmp_path):
    """Members only in the canonical order (build_archive's): a payload before its turn, or the
    signature after the manifest's payload. The stream cannot seek; the file path (the registry's
    upload check) refuses the same archives, so nothing registered is unreadable from S3."""
    ms = read_members(good_archive)
    by_name = {m.name: m for m in ms}
    swapped = [by_name[n] for n in ("manifest.json", "manifest.sig", "adapter_model.safetensors",
                                    "adapter_config.json")]  # fmt: skip
    sig_first = [by_name[n] for n in ("manifest.sig", "manifest.json", "adapter_config.json",
                                      "adapter_model.safetensors")]  # fmt: skip
    sig_last = [by_name[n] for n in ("manifest.json", "adapter_config.json", "adapter_model.safetensors",
                                     "manifest.sig")]  # fmt: skip
    for members, error, words in ((swapped, UnsafeArchiveError, "out of order"),
                                  (sig_first, UnsafeArchiveError, "out of order"),
                                  (sig_last, SignatureError, "not signed")):  # fmt: skip
        evil = write_tar(tmp_path / "evil.lar", members)
        with pytest.raises(UnsafeArchiveError, match="out of order"):  # signed and intact, only its order differs
            verify_archive(evil, [keys.public])
        with _stream(evil) as f, pytest.raises(error, match=words):
            extract_archive_stream(f, tmp_path / "out", [keys.public])
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", ["member", "garbage", "zeros"])
def test_only_the_tar_end_may_follow_the_weights(good_archive, keys, tmp_path, extra):
    ms = read_members(good_archive)
    if extra == "member":
        again = Member("adapter_config.json", get(ms, "adapter_config.json"))
        data = write_tar(tmp_path / "x.lar", ms + [again]).read_bytes()
    else:
        data = good_archive.read_bytes() + (b"\x00" * 4096 if extra == "zeros" else b"x" * 700)
    dest = tmp_path / "out"
    if extra == "zeros":
        extract_archive_stream(io.BytesIO(data), dest, [keys.public])
        assert sorted(_tree(dest)) == sorted(MEMBER_NAMES)
        return
    error, words = (UnsafeArchiveError, "twice") if extra == "member" else (CorruptArchiveError, "extra data")
    with pytest.raises(error, match=words):
        extract_archive_stream(io.BytesIO(data), dest, [keys.public])
    assert not dest.exists()


def test_content_checks_after_the_checksums(good_archive, keys, dev_model_b, tmp_path):
    from archives.basehash import base_model_hash

    with _stream(good_archive) as f, pytest.raises(BaseMismatchError, match="built for base"):
        extract_archive_stream(f, tmp_path / "out", [keys.public],
                               base_model_hash=base_model_hash(dev_model_b))  # fmt: skip
    with _stream(good_archive) as f, pytest.raises(RankLimitError, match="above the limit 8"):
        extract_archive_stream(f, tmp_path / "out", [keys.public], max_rank=8)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ the pipe


async def _chunks(data: bytes, size: int, *, fail_at: int | None = None, closed: list | None = None):
    try:
        for i in range(0, len(data), size):
            if fail_at is not None and i >= fail_at:
                raise StoreError("S3 get s3://b/k failed: connection reset")
            yield data[i : i + size]
            await asyncio.sleep(0)
    finally:
        if closed is not None:
            closed.append(True)


async def _extract_through_pipe(pipe, data, dest, keys, **kw):
    closed: list = []
    feeder = asyncio.create_task(pipe.feed(_chunks(data, 4096, closed=closed, **kw)))
    try:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, extract_archive_stream, pipe, dest, keys)
    finally:
        pipe.close()
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        assert closed == [True]  # the download is closed whatever happened


async def test_pipe_feeds_the_stream_extraction(good_archive, keys, tmp_path):
    data, pipe = good_archive.read_bytes(), ChunkPipe(depth=2)
    manifest = await _extract_through_pipe(pipe, data, tmp_path / "out", [keys.public])
    assert manifest.adapter_id and pipe.nbytes == len(data)
    assert sorted(_tree(tmp_path / "out")) == sorted(MEMBER_NAMES)


async def test_a_failed_download_fails_the_extraction(good_archive, keys, tmp_path):
    data = good_archive.read_bytes()
    with pytest.raises(StoreError, match="connection reset"):
        await _extract_through_pipe(ChunkPipe(depth=2), data, tmp_path / "out", [keys.public],
                                    fail_at=len(data) // 2)  # fmt: skip
    assert not (tmp_path / "out").exists()


async def test_a_failed_extraction_stops_the_download(good_archive, keys, tmp_path):
    """Bad signature: the reader gives up after the first chunks; the feeder, held back by the
    bounded pipe, is cancelled and closes the download instead of reading it to the end."""
    members = _edit_manifest_after_signing(read_members(good_archive), keys, None, tmp_path)
    data = write_tar(tmp_path / "bad.lar", members).read_bytes() + b"\x00" * (1 << 20)
    pipe = ChunkPipe(depth=2)
    with pytest.raises(SignatureError):
        await _extract_through_pipe(pipe, data, tmp_path / "out", [keys.public])
    assert pipe.nbytes < len(data) // 2
    assert not (tmp_path / "out").exists()


async def test_pipe_backpressure_bounds_what_waits():
    pipe = ChunkPipe(depth=3)
    feeder = asyncio.create_task(pipe.feed(_chunks(b"x" * 100, 10)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert pipe.nbytes == 30 and not feeder.done()  # three chunks in, the fourth waits for room
    read_all = lambda: b"".join(iter(lambda: pipe.read(7), b""))  # noqa: E731
    out = await asyncio.get_running_loop().run_in_executor(None, read_all)
    await feeder
    assert out == b"x" * 100 and pipe.nbytes == 100
