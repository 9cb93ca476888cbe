"""Why an adapter cannot be served: unknown to this replica, or its load failed (with a code)."""

from __future__ import annotations

import re

from archives import errors as ae
from handler.engine.errors import InvalidAdapterError as EngineInvalidAdapter

SAFE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class AdapterNotFoundError(Exception):
    """Neither a local tier nor the adapter source knows this adapter id."""

    def __init__(self, adapter_id: str, message: str | None = None):
        super().__init__(message or f"adapter {adapter_id} is not known to this replica's registry/catalog")
        self.adapter_id = adapter_id


class AdapterLoadError(Exception):
    """A load failed. `code` names the reason for clients: bad_signature, checksum_mismatch,
    base_mismatch, rank_limit, invalid_adapter, unsafe_archive, store_error, fetch_failed, ..."""

    def __init__(self, adapter_id: str, code: str, message: str):
        super().__init__(f"adapter {adapter_id} cannot be loaded ({code}): {message}")
        self.adapter_id = adapter_id
        self.code = code
        self.reason = message


def error_code(e: BaseException) -> str:
    if isinstance(e, EngineInvalidAdapter):
        return "invalid_adapter"
    for cls, code in (
        (ae.SignatureError, "bad_signature"),
        (ae.ChecksumError, "checksum_mismatch"),
        (ae.BaseMismatchError, "base_mismatch"),
        (ae.RankLimitError, "rank_limit"),
        (ae.UnsafeArchiveError, "unsafe_archive"),
        (ae.CorruptArchiveError, "corrupt_archive"),
        (ae.ObjectNotFoundError, "archive_not_found"),
        (ae.StoreError, "store_error"),
        (ae.InvalidAdapterError, "invalid_adapter"),
        (ae.ArchiveError, "invalid_archive"),
    ):
        if isinstance(e, cls):
            return code
    return "load_failed"


def check_adapter_id(adapter_id: str) -> str:
    """Adapter ids become folder names: accept only a safe, short token (no path separators, no `..`)."""
    if not SAFE_ID_RE.match(adapter_id) or ".." in adapter_id:
        raise AdapterNotFoundError(adapter_id, f"invalid adapter id {adapter_id!r}")
    return adapter_id
