"""Small filesystem helpers for atomic, durable writes (temp file + fsync + rename)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

from archives.digest import BLOCK


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in `path` durable (the directory entry itself is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_copy(src: BinaryIO, dest: Path) -> int:
    """Copy `src` to a temp file beside `dest`, fsync, rename over `dest`; return bytes copied.
    Readers of `dest` see the old file or the whole new one, never a partial one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, BLOCK)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)
    return size
