"""The archive manifest: what an archive claims, and the exact bytes that get signed.

The signature covers `Manifest.canonical_bytes()`: JSON with sorted keys, no whitespace, ASCII
only. `manifest.json` in the archive holds exactly those bytes, and the verifier checks the
signature over the raw member bytes before parsing them, so a parser quirk can never change what
was signed.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from archives.errors import CorruptArchiveError
from archives.ids import ADAPTER_ID_RE, SHA256_RE, TENANT_ID_RE

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PAYLOAD_NAMES = (CONFIG_NAME, WEIGHTS_NAME)  # the files listed in Manifest.files
MEMBER_NAMES = (MANIFEST_NAME, SIGNATURE_NAME, CONFIG_NAME, WEIGHTS_NAME)  # the tar, in this order

Sha256 = Annotated[str, Field(pattern=SHA256_RE.pattern, strict=True)]
# Strict numbers: "16" or true are not a rank. (created_at stays lax so a manifest read back from
# JSON as a dict, with its ISO string, still validates.)
StrictFloat = Annotated[float, Field(strict=True)]


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: Sha256
    size: StrictInt = Field(ge=0)


class Manifest(BaseModel):
    """Signed description of one adapter archive (format version 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = FORMAT_VERSION
    adapter_id: str = Field(pattern=ADAPTER_ID_RE.pattern, strict=True)
    tenant_id: str = Field(pattern=TENANT_ID_RE.pattern, strict=True)
    version: StrictInt = Field(ge=1)
    base_model_hash: Sha256
    rank: StrictInt = Field(ge=1)
    alpha: StrictFloat = Field(gt=0, allow_inf_nan=False)
    target_modules: list[Annotated[str, Field(strict=True)]] = Field(min_length=1)
    created_at: datetime
    files: dict[str, FileEntry]

    @field_validator("target_modules")
    @classmethod
    def _sorted_unique(cls, v: list[str]) -> list[str]:
        return sorted(set(v))  # one spelling per set, so equal content signs equal bytes

    @field_validator("created_at")
    @classmethod
    def _utc_seconds(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("created_at needs a timezone")
        return v.astimezone(timezone.utc).replace(microsecond=0)

    @field_validator("files")
    @classmethod
    def _payload_files(cls, v: dict[str, FileEntry]) -> dict[str, FileEntry]:
        if sorted(v) != sorted(PAYLOAD_NAMES):
            raise ValueError(f"files must list exactly {', '.join(PAYLOAD_NAMES)}")
        return v

    def canonical_bytes(self) -> bytes:
        """The signed bytes: sorted keys, no whitespace, ASCII JSON."""
        data = self.model_dump(mode="json")
        data["created_at"] = self.created_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse manifest.json bytes; CorruptArchiveError when they are not a valid manifest."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "manifest"
            raise CorruptArchiveError(f"manifest.json is invalid: {where}: {first['msg']}") from None
        except (ValueError, RecursionError):
            raise CorruptArchiveError("manifest.json is not valid JSON") from None
