"""Extract a verified `.lar` into a folder, safely.

The archive is fully verified (signature, checksums, content) before anything is written. Then
each allowed member's bytes are copied, through tarfile.extractfile, into a temp file inside
`dest_dir` whose name we choose (never a path from the tar), re-hashed on the way (the archive
file could change after verification), fsynced, and only when all four are complete renamed to
`dest_dir/<member name>`. On any failure the temp files are removed, and `dest_dir` too if this
call created it.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from archives.digest import bytes_sha256, copy_and_hash
from archives.errors import ArchiveError, ChecksumError, CorruptArchiveError
from archives.fsutil import fsync_dir
from archives.manifest import MANIFEST_NAME, MEMBER_NAMES, PAYLOAD_NAMES, SIGNATURE_NAME, Manifest
from archives.reader import open_archive
from archives.verify import TrustedKeys, verify_open_archive


class Staging:
    """Temp files in `dest` (names we choose, never a path from the tar) that become
    `dest/<member>` together on `commit`, or vanish. Made by `staging()`."""

    def __init__(self, dest: Path):
        self.dest = dest
        self.temps: dict[str, str] = {}

    def open(self, name: str) -> BinaryIO:
        """A new temp file for member `name` (`dest` is created on the first one)."""
        self.dest.mkdir(parents=True, exist_ok=True)
        fd, self.temps[name] = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=self.dest)
        return os.fdopen(fd, "wb")

    def write(self, name: str, data: bytes) -> None:
        with self.open(name) as out:
            out.write(data)

    def path(self, name: str) -> Path:
        return Path(self.temps[name])

    def commit(self) -> None:
        for name in MEMBER_NAMES:
            os.replace(self.temps.pop(name), self.dest / name)


@contextmanager
def staging(dest_dir: str | os.PathLike) -> Iterator[Staging]:
    """Stage an extraction into `dest_dir`: on any failure inside the block the temp files are
    removed, and `dest_dir` too if this call created it; an OSError becomes ArchiveError."""
    dest = Path(dest_dir)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ArchiveError(f"extraction target {dest} exists and is not a folder")
    created = not dest.exists()
    stage = Staging(dest)
    try:
        yield stage
    except BaseException as e:
        for tmp in stage.temps.values():
            Path(tmp).unlink(missing_ok=True)
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        if isinstance(e, OSError):
            raise ArchiveError(f"cannot extract into {dest}: {e.strerror or e}") from None
        raise


def extract_archive(
    path: str | os.PathLike,
    dest_dir: str | os.PathLike,
    trusted_keys: TrustedKeys,
    *,
    base_model_hash: str | None = None,
    max_rank: int | None = None,
    base_config: dict | None = None,
    progress: bool = False,
) -> Manifest:
    """Verify the archive at `path` (as verify_archive), then write its four files into
    `dest_dir` (created if missing; other files there are left alone). Returns the manifest.

    Raises an ArchiveError subclass; on failure nothing of this call remains in `dest_dir`.
    """
    with staging(dest_dir) as stage, open_archive(path) as reader:
        verified = verify_open_archive(
            reader, trusted_keys, base_model_hash=base_model_hash, max_rank=max_rank,
            base_config=base_config, progress=progress,
        )  # fmt: skip
        manifest = verified.manifest
        expected = {
            MANIFEST_NAME: bytes_sha256(verified.manifest_bytes),
            SIGNATURE_NAME: bytes_sha256(verified.signature),
            **{name: manifest.files[name].sha256 for name in PAYLOAD_NAMES},
        }
        for name in MEMBER_NAMES:
            with stage.open(name) as out:
                try:
                    with reader.open_member(name) as src:
                        digest = copy_and_hash(
                            src, out, reader.size(name), desc=f"extract {name}", progress=progress
                        )
                except (EOFError, tarfile.TarError):  # the file shrank after verification
                    raise CorruptArchiveError(f"member {name!r} is truncated") from None
                if digest != expected[name]:
                    raise ChecksumError(
                        f"{name} changed while being extracted (archive modified after verification)"
                    )
                out.flush()
                os.fsync(out.fileno())
        stage.commit()
        fsync_dir(stage.dest)
    return manifest


def extract_archive_one_pass(
    path: str | os.PathLike,
    dest_dir: str | os.PathLike,
    trusted_keys: TrustedKeys,
    *,
    base_model_hash: str | None = None,
    max_rank: int | None = None,
    base_config: dict | None = None,
) -> Manifest:
    """As `extract_archive`, with the payload read once: the checks are the same and in the same
    order (member allowlist, signature, sizes, sha256s, content, base hash, rank limit), but each
    payload member is written to its temp file in `dest_dir` while it is hashed for verification.
    Nothing is written before the signature and the sizes hold; the temp files become
    `dest_dir/<member>` only after every check passed, and are removed otherwise. No fsync: for
    caches that re-check checksums after a crash (the replica's disk tier), not for the archive
    of record. Returns the manifest; raises an ArchiveError subclass."""
    with staging(dest_dir) as stage:
        sinks = {name: stage.open(name) for name in PAYLOAD_NAMES}
        try:
            with open_archive(path) as reader:
                verified = verify_open_archive(
                    reader, trusted_keys, base_model_hash=base_model_hash, max_rank=max_rank,
                    base_config=base_config, sinks=sinks,
                )  # fmt: skip
        finally:
            for f in sinks.values():
                f.close()
        stage.write(MANIFEST_NAME, verified.manifest_bytes)
        stage.write(SIGNATURE_NAME, verified.signature)
        stage.commit()
    return verified.manifest
