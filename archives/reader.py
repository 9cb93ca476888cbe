"""Open a `.lar` without trusting it: the member allowlist, enforced on tar headers only.

Nothing here extracts or interprets tar paths. Members are looked up by their exact allowed
name; anything else in the archive (another name, a duplicate, a link, a device, a directory, an
absolute or `..` path, a sparse file, a size over its cap) is refused before a byte of data is
read. Callers read member data through `read_bytes` / `open_member` only.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import BinaryIO

from archives.errors import ArchiveError, CorruptArchiveError, UnsafeArchiveError
from archives.limits import MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES, MAX_WEIGHTS_BYTES, SIGNATURE_BYTES
from archives.manifest import CONFIG_NAME, MANIFEST_NAME, MEMBER_NAMES, SIGNATURE_NAME, WEIGHTS_NAME
from archives.peft_dir import PICKLE_SUFFIXES

MEMBER_CAPS = {
    MANIFEST_NAME: MAX_MANIFEST_BYTES,
    SIGNATURE_NAME: SIGNATURE_BYTES,
    CONFIG_NAME: MAX_CONFIG_BYTES,
    WEIGHTS_NAME: MAX_WEIGHTS_BYTES,
}

_COMPRESSED_MAGIC = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}

# What tarfile raises on malformed input; anything of these becomes CorruptArchiveError.
TAR_FAILURES = (tarfile.TarError, EOFError, ValueError, UnicodeError, OverflowError, OSError)


def _kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return "a symbolic link"
    if m.islnk():
        return "a hard link"
    if m.isdir():
        return "a directory"
    if m.ischr() or m.isblk():
        return "a device"
    if m.isfifo():
        return "a FIFO"
    if m.issparse():
        return "a sparse file"
    return f"not a regular file (tar type {m.type!r})"


def check_uncompressed(head: bytes, name: str) -> None:
    """Refuse a compressed archive by its first bytes (a clearer message than a bad tar header)."""
    for magic, kind in _COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            raise CorruptArchiveError(f"archive {name} is {kind}-compressed; a .lar is an uncompressed tar")


def check_member(m: tarfile.TarInfo) -> None:
    """Raise UnsafeArchiveError unless `m` is an allowed regular file within its size cap."""
    name = m.name
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"member {name!r} has an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise UnsafeArchiveError(f"member {name!r} has a '..' path component")
    if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        raise UnsafeArchiveError(f"member {name!r} is {_kind(m)}; only regular files are allowed")
    if name not in MEMBER_CAPS:
        hint = " (pickle weights are never accepted)" if name.lower().endswith(PICKLE_SUFFIXES) else ""
        raise UnsafeArchiveError(
            f"unexpected member {name!r}{hint}; an archive holds only {', '.join(MEMBER_NAMES)}"
        )
    cap = MEMBER_CAPS[name]
    if m.size > cap:
        raise UnsafeArchiveError(f"member {name!r} is {m.size} bytes, over its {cap}-byte limit")


class ArchiveReader:
    """An opened archive whose tar headers passed `check_member`. Use as a context manager."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file: BinaryIO = open(self.path, "rb")
        except OSError as e:
            raise CorruptArchiveError(f"cannot read archive {self.path}: {e.strerror or e}") from None
        try:
            self._open()
        except BaseException:
            self._file.close()
            raise

    def _open(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(6)
        self._file.seek(0)
        check_uncompressed(head, self.path.name)
        self.members: dict[str, tarfile.TarInfo] = {}
        try:
            self._tar = tarfile.open(fileobj=self._file, mode="r:")
            while (m := self._tar.next()) is not None:
                check_member(m)
                if m.name in self.members:
                    raise UnsafeArchiveError(f"member {m.name!r} appears twice")
                if m.offset_data + m.size > size:
                    raise CorruptArchiveError(f"member {m.name!r} is truncated")
                self.members[m.name] = m
            canonical = [n for n in MEMBER_NAMES if n in self.members]
            if list(self.members) != canonical:
                # the format's order (build_archive's): a replica streaming from S3 cannot seek, so an
                # archive accepted here must be readable front to back
                raise UnsafeArchiveError(
                    f"archive {self.path.name} has its members out of order ({', '.join(self.members)}); "
                    f"the order is {', '.join(MEMBER_NAMES)}")
            self._check_tail()
        except ArchiveError:
            raise
        except TAR_FAILURES as e:
            raise CorruptArchiveError(
                f"archive {self.path.name} is not a readable tar: {e or type(e).__name__}"
            ) from None

    def _check_tail(self) -> None:
        """tarfile stops quietly at a damaged header after the first member; only the zero
        blocks that end a tar may follow the last member we read."""
        self._file.seek(self._tar.offset)
        while block := self._file.read(1024 * 1024):
            if block.count(0) != len(block):
                last = list(self.members)[-1] if self.members else None
                where = f"after member {last!r}" if last else "at the start"
                raise CorruptArchiveError(
                    f"archive {self.path.name} has a damaged tar header or extra data {where}"
                )

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def size(self, name: str) -> int:
        return self.members[name].size

    def open_member(self, name: str) -> BinaryIO:
        """A seekable reader of one allowed member's bytes (never a path on disk)."""
        try:
            f = self._tar.extractfile(self.members[name])
        except TAR_FAILURES as e:
            raise CorruptArchiveError(f"cannot read member {name!r}: {e}") from None
        assert f is not None  # regular files always have data
        return f

    def read_bytes(self, name: str) -> bytes:
        """The whole member (only for the small, capped members)."""
        m = self.members[name]
        try:
            with self.open_member(name) as f:
                data = f.read(m.size)
        except TAR_FAILURES as e:
            raise CorruptArchiveError(f"cannot read member {name!r}: {e}") from None
        if len(data) != m.size:
            raise CorruptArchiveError(f"member {name!r} is truncated")
        return data


def open_archive(path: str | os.PathLike) -> ArchiveReader:
    """Open `path` as an archive; raises ArchiveError subclasses only."""
    return ArchiveReader(path)
