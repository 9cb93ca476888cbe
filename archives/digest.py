"""sha256 checksums in the `sha256:<hex>` form used by manifests and the registry."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

from archives.limits import PROGRESS_MIN_BYTES

BLOCK = 1024 * 1024


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm byte counter on stderr, shown only when asked for and the job is large."""
    import sys

    from tqdm import tqdm

    enabled = enabled and total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()  # no bars in logs
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        disable=not enabled,
    )


def bytes_sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike, *, progress: bool = False) -> str:
    """`sha256:<hex>` of the file's bytes, read in 1 MiB blocks (never whole into memory)."""
    path = Path(path)
    h = hashlib.sha256()
    with (
        open(path, "rb") as f,
        progress_bar(os.fstat(f.fileno()).st_size, f"sha256 {path.name}", progress) as bar,
    ):
        while block := f.read(BLOCK):
            h.update(block)
            bar.update(len(block))
    return "sha256:" + h.hexdigest()


def copy_and_hash(
    src: BinaryIO, dst: BinaryIO | None, size: int, *, desc: str = "", progress: bool = False
) -> str:
    """Copy exactly `size` bytes from `src` to `dst` (or just read them when `dst` is None) and
    return their `sha256:<hex>`. Raises EOFError when `src` ends early: a truncated source must
    never pass for a complete one."""
    h = hashlib.sha256()
    left = size
    with progress_bar(size, desc, progress) as bar:
        while left:
            block = src.read(min(BLOCK, left))
            if not block:
                raise EOFError(f"{size - left} of {size} bytes")
            h.update(block)
            if dst is not None:
                dst.write(block)
            left -= len(block)
            bar.update(len(block))
    return "sha256:" + h.hexdigest()


class HashingReader:
    """Wraps a binary file: every byte read through it goes into a sha256 (so bytes copied into
    an archive are the bytes whose checksum is recorded, even if the source changes meanwhile)."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self._h = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        block = self._f.read(n)
        self._h.update(block)
        self.count += len(block)
        return block

    def hexdigest(self) -> str:
        return "sha256:" + self._h.hexdigest()
