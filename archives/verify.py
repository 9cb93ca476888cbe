"""Verify a `.lar` before anything trusts it.

Order, each step only after the previous one held:
1. the member allowlist (reader.py);
2. the Ed25519 signature over the raw manifest.json bytes, against the trusted keys;
3. every file's size and sha256 against the signed manifest;
4. adapter_config.json and the safetensors header agree with the manifest (rank, alpha, target
   modules) and have servable tensor names and shapes (also against the base config if given);
5. optionally, the base model hash and the fleet's rank limit.
Weights are only ever parsed as a safetensors header: nothing is unpickled.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from archives.digest import copy_and_hash
from archives.errors import (
    BaseMismatchError,
    ChecksumError,
    CorruptArchiveError,
    InvalidAdapterError,
    RankLimitError,
    SignatureError,
)
from archives.keys import key_id, load_public_keys, signed_by
from archives.limits import SIGNATURE_BYTES
from archives.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    PAYLOAD_NAMES,
    SIGNATURE_NAME,
    WEIGHTS_NAME,
    FileEntry,
    Manifest,
)
from archives.peft_dir import LoraSettings, check_adapter_config, check_lora_tensors
from archives.reader import ArchiveReader, open_archive
from archives.safetensors_header import read_header

TrustedKeys = Iterable[Ed25519PublicKey | str | os.PathLike]


@dataclass(frozen=True)
class VerifiedArchive:
    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes
    signer: str  # key_id of the trusted key that signed it


def trusted_list(keys: TrustedKeys | Ed25519PublicKey | str | os.PathLike) -> list[Ed25519PublicKey]:
    if isinstance(keys, Ed25519PublicKey):
        keys = [keys]
    elif isinstance(keys, str | os.PathLike):
        keys = load_public_keys(keys)  # one path, or LORAFARM_TRUST's ':'-separated list
    out: list[Ed25519PublicKey] = []
    for k in keys:
        out.extend([k] if isinstance(k, Ed25519PublicKey) else load_public_keys([k]))
    if not out:
        raise SignatureError("no trusted public keys: cannot verify the archive signature")
    return out


def _require(reader: ArchiveReader, name: str) -> None:
    if name not in reader.members:
        raise CorruptArchiveError(f"archive {reader.path.name} has no {name}")


def check_signature(
    manifest_bytes: bytes, signature: bytes, keys: list[Ed25519PublicKey], archive_name: str
) -> Ed25519PublicKey:
    """Step 2: the trusted key whose Ed25519 signature over the raw manifest bytes is `signature`;
    SignatureError when the signature is malformed or made by no trusted key."""
    if len(signature) != SIGNATURE_BYTES:
        raise SignatureError(
            f"{SIGNATURE_NAME} is {len(signature)} bytes, not a {SIGNATURE_BYTES}-byte Ed25519 signature"
        )
    signer = signed_by(signature, manifest_bytes, keys)
    if signer is None:
        raise SignatureError(
            f"manifest signature of {archive_name} matches none of the {len(keys)} trusted key(s): "
            f"the manifest was modified or signed by an untrusted key"
        )
    return signer


def check_size(name: str, size: int, entry: FileEntry) -> None:
    """Step 3, before a byte of the member is read: its size is the signed one."""
    if size != entry.size:
        raise ChecksumError(f"{name} is {size} bytes but the signed manifest says {entry.size}")


def check_digest(name: str, digest: str, entry: FileEntry) -> None:
    """Step 3: the member's sha256 is the signed one."""
    if digest != entry.sha256:
        raise ChecksumError(
            f"{name} does not match its sha256 in the signed manifest (corrupted or tampered)"
        )


def check_content(
    manifest: Manifest,
    config_bytes: bytes,
    weights: BinaryIO,
    weights_size: int,
    *,
    base_model_hash: str | None = None,
    max_rank: int | None = None,
    base_config: dict | None = None,
) -> None:
    """Steps 4 and 5 on payload bytes whose checksums already matched the signed manifest:
    adapter_config.json and the safetensors header (read from `weights`, a seekable file of
    `weights_size` bytes) agree with the manifest and are servable; then base hash and rank limit."""
    settings = check_adapter_config(config_bytes)
    if settings.rank != manifest.rank:
        raise InvalidAdapterError(
            f"manifest rank {manifest.rank} differs from {CONFIG_NAME} r={settings.rank}"
        )
    if settings.alpha != manifest.alpha:
        raise InvalidAdapterError(
            f"manifest alpha {manifest.alpha} differs from {CONFIG_NAME} lora_alpha={settings.alpha}"
        )
    if settings.target_modules != manifest.target_modules:
        raise InvalidAdapterError(
            f"manifest target_modules {manifest.target_modules} differ from "
            f"{CONFIG_NAME} {settings.target_modules}"
        )
    try:
        header = read_header(weights, weights_size)
    except ValueError as e:
        raise InvalidAdapterError(f"{WEIGHTS_NAME}: {e}") from None
    check_lora_tensors(
        header, LoraSettings(manifest.rank, manifest.alpha, manifest.target_modules), base_config
    )

    if base_model_hash is not None and manifest.base_model_hash != base_model_hash:
        raise BaseMismatchError(
            f"adapter {manifest.adapter_id} was built for base {manifest.base_model_hash}, "
            f"not for this base {base_model_hash}"
        )
    if max_rank is not None and manifest.rank > max_rank:
        raise RankLimitError(
            f"adapter {manifest.adapter_id} has rank {manifest.rank}, above the limit {max_rank}"
        )


def verify_open_archive(
    reader: ArchiveReader,
    trusted_keys: TrustedKeys,
    *,
    base_model_hash: str | None = None,
    max_rank: int | None = None,
    base_config: dict | None = None,
    progress: bool = False,
    sinks: dict[str, BinaryIO] | None = None,
) -> VerifiedArchive:
    """verify_archive on an already opened archive; also returns the verified manifest bytes.

    `sinks` (payload name -> writable file): the payload bytes are written there while they are
    hashed (one pass for verify + extract). What lands in a sink is unverified until this returns:
    the caller must discard the sinks when it raises."""
    keys = trusted_list(trusted_keys)
    if SIGNATURE_NAME not in reader.members:
        raise SignatureError(f"archive {reader.path.name} is not signed (no {SIGNATURE_NAME})")
    _require(reader, MANIFEST_NAME)
    signature = reader.read_bytes(SIGNATURE_NAME)
    manifest_bytes = reader.read_bytes(MANIFEST_NAME)
    signer = check_signature(manifest_bytes, signature, keys, reader.path.name)
    manifest = Manifest.from_bytes(manifest_bytes)

    for name in PAYLOAD_NAMES:
        _require(reader, name)
        entry = manifest.files[name]
        size = reader.size(name)
        check_size(name, size, entry)
        try:
            with reader.open_member(name) as f:
                sink = (sinks or {}).get(name)
                digest = copy_and_hash(f, sink, size, desc=f"verify {name}", progress=progress)
        except (EOFError, OSError, tarfile.TarError) as e:
            raise CorruptArchiveError(f"member {name!r} is truncated: {e}") from None
        check_digest(name, digest, entry)

    config_bytes = reader.read_bytes(CONFIG_NAME)
    with reader.open_member(WEIGHTS_NAME) as weights:
        check_content(
            manifest, config_bytes, weights, reader.size(WEIGHTS_NAME),
            base_model_hash=base_model_hash, max_rank=max_rank, base_config=base_config,
        )  # fmt: skip
    return VerifiedArchive(manifest, manifest_bytes, signature, key_id(signer))


def verify_archive(
    path: str | os.PathLike,
    trusted_keys: TrustedKeys,
    *,
    base_model_hash: str | None = None,
    max_rank: int | None = None,
    base_config: dict | None = None,
    progress: bool = False,
) -> Manifest:
    """Verify the archive at `path` (see module docstring) and return its manifest.

    `trusted_keys`: Ed25519 public keys (or PEM paths). Raises an ArchiveError subclass:
    UnsafeArchiveError / CorruptArchiveError (structure), SignatureError, ChecksumError,
    InvalidAdapterError (content), BaseMismatchError, RankLimitError.
    """
    with open_archive(path) as reader:
        return verify_open_archive(
            reader, trusted_keys, base_model_hash=base_model_hash, max_rank=max_rank,
            base_config=base_config, progress=progress,
        ).manifest  # fmt: skip


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of an archive WITHOUT checking its signature (for `inspect` and listings)."""
    with open_archive(path) as reader:
        _require(reader, MANIFEST_NAME)
        return Manifest.from_bytes(reader.read_bytes(MANIFEST_NAME))
