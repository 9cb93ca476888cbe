"""Build a signed `.lar` from a PEFT adapter folder.

The folder is validated first (peft_dir.py). The tar is written to a temp file beside `out_path`,
fsynced and renamed into place, so readers see the whole archive or none. The payload bytes are
hashed again while being copied into the tar and compared with the manifest, so a source file
that changes during the build fails the build instead of producing an archive that never verifies.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from archives.digest import HashingReader
from archives.errors import ArchiveError, InvalidAdapterError
from archives.fsutil import fsync_dir
from archives.ids import ADAPTER_ID_RE, SHA256_RE, TENANT_ID_RE, adapter_id_for
from archives.keys import load_private_key, sign
from archives.manifest import CONFIG_NAME, MANIFEST_NAME, SIGNATURE_NAME, WEIGHTS_NAME, FileEntry, Manifest
from archives.peft_dir import read_peft_dir


def _tarinfo(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = mtime
    info.mode = 0o644
    info.type = tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_archive(
    peft_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    private_key: Ed25519PrivateKey | str | os.PathLike,
    tenant_id: str,
    adapter_id: str | None = None,
    version: int = 1,
    base_model_hash: str,
    base_config: dict | None = None,
    created_at: datetime | None = None,
    progress: bool = False,
) -> Manifest:
    """Validate `peft_dir`, sign its manifest and write the archive atomically to `out_path`.

    `adapter_id` None means `ids.adapter_id_for(tenant_id, content_checksum)`. `base_config` (the
    base's config.json dict) enables the tensor-shape check against the base. Raises
    InvalidAdapterError for a bad adapter or argument, other ArchiveError subclasses otherwise.
    """
    if not TENANT_ID_RE.match(tenant_id or ""):
        raise InvalidAdapterError(f"tenant_id {tenant_id!r} is not a valid slug ([a-z0-9][a-z0-9-]{{1,62}})")
    if adapter_id is not None and not ADAPTER_ID_RE.match(adapter_id):
        raise InvalidAdapterError(f"adapter_id {adapter_id!r} is not of the form ad-<20 hex>")
    if type(version) is not int or version < 1:
        raise InvalidAdapterError(f"version must be a positive integer, got {version!r}")
    if not SHA256_RE.match(base_model_hash or ""):
        raise InvalidAdapterError(f"base_model_hash {base_model_hash!r} is not of the form sha256:<64 hex>")
    if not isinstance(private_key, Ed25519PrivateKey):
        private_key = load_private_key(private_key)
    created_at = created_at or datetime.now(timezone.utc)

    src = Path(peft_dir)
    info = read_peft_dir(src, base_config, progress=progress)
    manifest = Manifest(
        adapter_id=adapter_id or adapter_id_for(tenant_id, info.content_checksum),
        tenant_id=tenant_id,
        version=version,
        base_model_hash=base_model_hash,
        rank=info.rank,
        alpha=info.alpha,
        target_modules=info.target_modules,
        created_at=created_at,
        files={
            CONFIG_NAME: FileEntry(sha256=info.config_sha256, size=info.config_size),
            WEIGHTS_NAME: FileEntry(sha256=info.weights_sha256, size=info.weights_size),
        },
    )
    manifest_bytes = manifest.canonical_bytes()
    signature = sign(private_key, manifest_bytes)

    out = Path(out_path)
    mtime = int(manifest.created_at.timestamp())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise ArchiveError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.addfile(_tarinfo(MANIFEST_NAME, len(manifest_bytes), mtime), io.BytesIO(manifest_bytes))
                tar.addfile(_tarinfo(SIGNATURE_NAME, len(signature), mtime), io.BytesIO(signature))
                for name in (CONFIG_NAME, WEIGHTS_NAME):
                    entry = manifest.files[name]
                    with open(src / name, "rb") as payload:
                        reader = HashingReader(payload)
                        try:
                            tar.addfile(_tarinfo(name, entry.size, mtime), reader)
                        except (OSError, tarfile.TarError):
                            raise InvalidAdapterError(
                                f"{src / name} changed while the archive was built"
                            ) from None
                        if reader.count != entry.size or reader.hexdigest() != entry.sha256:
                            raise InvalidAdapterError(f"{src / name} changed while the archive was built")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ArchiveError(f"cannot write {out}: {e.strerror or e}") from None
        raise
    return manifest
