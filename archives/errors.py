"""The archive error types.

Every failure of reading, verifying, extracting or storing an adapter archive raises an
`ArchiveError` subclass with a one-line message naming what is wrong, so callers (registry,
replica, CLI) can catch one type and still tell a tampered file from a missing object.
"""

from __future__ import annotations


class ArchiveError(Exception):
    """Base class of every error raised by the `archives` package."""


class InvalidAdapterError(ArchiveError):
    """The adapter itself is unusable: bad adapter_config.json, pickle weights, wrong tensor
    names or shapes, rank in the manifest that disagrees with the tensors."""


class InvalidBaseModelError(ArchiveError):
    """A base model folder has no readable safetensors checkpoint (base hash cannot be computed)."""


class SignatureError(ArchiveError):
    """manifest.sig is missing, malformed, or not made by any trusted key."""


class ChecksumError(ArchiveError):
    """A file's size or sha256 differs from the signed manifest."""


class BaseMismatchError(ArchiveError):
    """The adapter was built for another base model (base_model_hash differs)."""


class RankLimitError(ArchiveError):
    """The adapter's rank is above the fleet's limit."""


class UnsafeArchiveError(ArchiveError):
    """A tar member breaks the allowlist: unknown or duplicate name, link, device, directory,
    absolute or `..` path, or a size over the cap."""


class CorruptArchiveError(ArchiveError):
    """The file is not a readable uncompressed tar, a member is truncated, or the manifest is
    not valid JSON of the manifest schema."""


class KeyFileError(ArchiveError):
    """A key file is missing, unreadable, or not an Ed25519 key of the expected kind."""


class StoreError(ArchiveError):
    """The object store failed (unreachable, access denied, invalid key or URL)."""


class ObjectNotFoundError(StoreError):
    """The requested key does not exist in the object store."""
