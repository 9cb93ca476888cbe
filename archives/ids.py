"""Identifier formats shared by registry, replica and CLI (docs/contracts.md, "Identifiers")."""

from __future__ import annotations

import hashlib
import re

TENANT_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{1,62}$")
ADAPTER_ID_RE = re.compile(r"^ad-[0-9a-f]{20}$")
SHA256_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def adapter_id_for(tenant_id: str, content_checksum: str) -> str:
    """The registry's adapter id: `ad-` + sha256(tenant_id + "\\0" + content_checksum)[:20].

    `content_checksum` is `PeftAdapterInfo.content_checksum` ("sha256:<hex>", prefix included),
    so uploading the same files twice gives the same id and two tenants never share one.
    """
    digest = hashlib.sha256(f"{tenant_id}\0{content_checksum}".encode()).hexdigest()
    return f"ad-{digest[:20]}"
