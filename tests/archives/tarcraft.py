"""Hand-made tar files for the attack tests: any member name, type and content we choose."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


@dataclass
class Member:
    name: str
    data: bytes = b""
    type: bytes = tarfile.REGTYPE
    linkname: str = ""
    size: int | None = None  # header size when it should differ from len(data)


def read_members(archive: Path) -> list[Member]:
    """The members of a (good) archive, in order."""
    with tarfile.open(archive, "r:") as tar:
        return [Member(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def write_tar(path: Path, members: list[Member]) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type = m.type
            info.linkname = m.linkname
            info.mode = 0o644
            if m.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
                info.size = len(m.data)
                tar.addfile(info, io.BytesIO(m.data))
            else:
                tar.addfile(info)
    return path


def replace(members: list[Member], name: str, data: bytes) -> list[Member]:
    return [Member(m.name, data) if m.name == name else m for m in members]


def without(members: list[Member], name: str) -> list[Member]:
    return [m for m in members if m.name != name]


def get(members: list[Member], name: str) -> bytes:
    return next(m.data for m in members if m.name == name)


def resigned(members: list[Member], key: Ed25519PrivateKey, **changes) -> list[Member]:
    """Members with the manifest edited (`changes` merged into its JSON) and signed by `key`:
    a validly signed archive whose content is wrong, to test the checks after the signature."""
    manifest = json.loads(get(members, "manifest.json"))
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(manifest.get(k), dict):
            manifest[k] = {**manifest[k], **v}
        else:
            manifest[k] = v
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return replace(replace(members, "manifest.json", body), "manifest.sig", key.sign(body))


def with_files(members: list[Member]) -> list[Member]:
    """Members whose manifest `files` entries are updated to the current payload bytes
    (call `resigned` afterwards)."""
    import hashlib

    manifest = json.loads(get(members, "manifest.json"))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = get(members, name)
        manifest["files"][name] = {"sha256": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return replace(members, "manifest.json", body)
