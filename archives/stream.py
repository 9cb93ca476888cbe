"""Verify and extract a `.lar` while it streams in (a download): one pass, no copy of the archive.

The checks of `verify_open_archive` + `extract_archive_one_pass`, in the same order, on a stream
read once from start to end. That needs the members in the canonical order, manifest.json,
manifest.sig, adapter_config.json, adapter_model.safetensors (`MEMBER_NAMES`, as build_archive
writes them); an archive in any other order is refused.

1. every tar header passes `check_member` (allowlist, size caps, regular files only), no name twice;
2. manifest.json and manifest.sig (small, capped) are read into memory and the Ed25519 signature is
   checked over the raw manifest bytes: no payload byte is written anywhere before it holds;
3. each payload's size is the signed one before its bytes are read; the bytes go into a temp file
   in `dest_dir` while they are hashed, and the sha256 must be the signed one;
4. after the weights only the zero blocks that end a tar may follow;
5. the content checks (`check_content`: config, safetensors header of the written temp file,
   tensor names and shapes, base hash, rank limit).
Only then do the temp files become `dest_dir/<member>`; on any failure nothing of this call remains.
"""

from __future__ import annotations

import os
import tarfile
from typing import BinaryIO

from archives.digest import BLOCK, copy_and_hash
from archives.errors import CorruptArchiveError, SignatureError, UnsafeArchiveError
from archives.extract import staging
from archives.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    MEMBER_NAMES,
    PAYLOAD_NAMES,
    SIGNATURE_NAME,
    WEIGHTS_NAME,
    Manifest,
)
from archives.reader import TAR_FAILURES, check_member, check_uncompressed
from archives.verify import (
    TrustedKeys,
    check_content,
    check_digest,
    check_signature,
    check_size,
    trusted_list,
)


class _Rewound:
    """`head` (already read off `f`) and then the rest of `f`."""

    def __init__(self, head: bytes, f: BinaryIO):
        self._head, self._f = head, f

    def read(self, n: int = -1) -> bytes:
        if self._head:
            out = self._head if n < 0 else self._head[:n]
            self._head = self._head[len(out) :]
            return out
        return self._f.read(n)


def _read_head(f: BinaryIO, n: int) -> bytes:
    out = b""
    while len(out) < n and (block := f.read(n - len(out))):
        out += block
    return out


class _Members:
    """The members of a tar stream, taken one by one in the canonical order."""

    def __init__(self, f: BinaryIO, name: str):
        self.name = name
        self.seen: list[str] = []

        class Tap(tarfile.TarInfo):  # keeps the last header block tarfile read (see `check_end`)
            block = b""

            @classmethod
            def frombuf(cls, buf, encoding, errors):
                Tap.block = buf
                return super().frombuf(buf, encoding, errors)

        self._tap = Tap
        try:
            self.tar = tarfile.open(fileobj=f, mode="r|", bufsize=BLOCK, tarinfo=Tap)
        except TAR_FAILURES as e:
            raise CorruptArchiveError(
                f"archive {name} is not a readable tar: {e or type(e).__name__}"
            ) from None

    def _next(self) -> tarfile.TarInfo | None:
        try:
            m = self.tar.next()
        except TAR_FAILURES as e:
            raise CorruptArchiveError(f"archive {self.name} has a damaged tar header: {e}") from None
        if m is not None:
            check_member(m)
            if m.name in self.seen:
                raise UnsafeArchiveError(f"member {m.name!r} appears twice")
            self.seen.append(m.name)
        return m

    def next(self, expected: str) -> tarfile.TarInfo:
        """The next member, which must be `expected`."""
        m = self._next()
        if m is not None and m.name == expected:
            return m
        if expected == SIGNATURE_NAME:
            raise SignatureError(
                f"archive {self.name} is not signed (no {SIGNATURE_NAME} right after {MANIFEST_NAME})"
            )
        if m is None:
            raise CorruptArchiveError(f"archive {self.name} has no {expected}")
        raise UnsafeArchiveError(
            f"member {m.name!r} is out of order: an archive holds {', '.join(MEMBER_NAMES)} in this order"
        )

    def read_small(self, expected: str) -> bytes:
        """The whole next member (only for the small, capped ones)."""
        m = self.next(expected)
        try:
            data = self.tar.extractfile(m).read(m.size)
        except TAR_FAILURES:
            data = b""
        if len(data) != m.size:
            raise CorruptArchiveError(f"member {expected!r} is truncated")
        return data

    def copy(self, m: tarfile.TarInfo, out: BinaryIO) -> str:
        """Copy member `m`'s bytes to `out`; their sha256."""
        try:
            with self.tar.extractfile(m) as src:
                return copy_and_hash(src, out, m.size)
        except (EOFError, tarfile.TarError) as e:
            raise CorruptArchiveError(f"member {m.name!r} is truncated: {e}") from None

    def check_end(self) -> None:
        """After the last member: no further member, and only zero blocks up to the end."""
        last = self.seen[-1]
        self._tap.block = b""
        if self._next() is not None:  # an allowed, unseen name cannot be left: checked above
            raise UnsafeArchiveError(f"archive {self.name} has a member after {last!r}")
        # tarfile stops quietly at a damaged header: the block it stopped at must be zeros too
        tail = self._tap.block
        try:
            while tail.count(0) == len(tail):
                if not (tail := self.tar.fileobj.read(BLOCK)):
                    return
        except TAR_FAILURES:
            pass
        raise CorruptArchiveError(
            f"archive {self.name} has a damaged tar header or extra data after member {last!r}"
        )


def extract_archive_stream(
    fileobj: BinaryIO,
    dest_dir: str | os.PathLike,
    trusted_keys: TrustedKeys,
    *,
    base_model_hash: str | None = None,
    max_rank: int | None = None,
    base_config: dict | None = None,
    name: str = "archive",
) -> Manifest:
    """Verify and extract the `.lar` read from `fileobj` (any object with `read(n)`; read once, in
    order, never seeked) into `dest_dir` (see the module docstring). `name` names the archive in
    messages. Returns the manifest; raises an ArchiveError subclass, or what `fileobj.read` raised
    (a failed download). On failure nothing of this call remains in `dest_dir`."""
    keys = trusted_list(trusted_keys)
    with staging(dest_dir) as stage:
        head = _read_head(fileobj, 6)
        check_uncompressed(head, name)
        members = _Members(_Rewound(head, fileobj), name)
        manifest_bytes = members.read_small(MANIFEST_NAME)
        signature = members.read_small(SIGNATURE_NAME)
        check_signature(manifest_bytes, signature, keys, name)
        manifest = Manifest.from_bytes(manifest_bytes)

        for member in PAYLOAD_NAMES:
            m = members.next(member)
            entry = manifest.files[member]
            check_size(member, m.size, entry)
            with stage.open(member) as out:
                digest = members.copy(m, out)
            check_digest(member, digest, entry)
        members.check_end()

        with open(stage.path(WEIGHTS_NAME), "rb") as weights:
            check_content(
                manifest, stage.path(CONFIG_NAME).read_bytes(), weights, manifest.files[WEIGHTS_NAME].size,
                base_model_hash=base_model_hash, max_rank=max_rank, base_config=base_config,
            )  # fmt: skip
        stage.write(MANIFEST_NAME, manifest_bytes)
        stage.write(SIGNATURE_NAME, signature)
        stage.commit()
    return manifest
