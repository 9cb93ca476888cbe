"""Ed25519 signing keys (PEM files), via the `cryptography` package.

The registry signs with one private key (`private.pem`, mode 0600, PKCS#8, unencrypted so a
service can start unattended; protect it with file permissions or a secret store). Replicas and
the CLI verify with a set of trusted public keys, so keys can be rotated by trusting old and new
at once.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from archives.errors import KeyFileError

PRIVATE_NAME = "private.pem"
PUBLIC_NAME = "public.pem"
_PEM_BEGIN = b"-----BEGIN PUBLIC KEY-----"
_PEM_END = b"-----END PUBLIC KEY-----"


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short fingerprint for messages and logs: `ed25519:` + 16 hex of sha256(raw key)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)  # never follow or clobber
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def generate_keypair(out_dir: str | os.PathLike, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new `private.pem` (mode 0600) and `public.pem` into `out_dir` (created if missing).

    Returns (private_path, public_path). Refuses to replace an existing key unless `overwrite`.
    """
    out = Path(out_dir)
    priv_path, pub_path = out / PRIVATE_NAME, out / PUBLIC_NAME
    try:
        out.mkdir(parents=True, exist_ok=True)
        for p in (priv_path, pub_path):
            if p.exists() or p.is_symlink():
                if not overwrite:
                    raise KeyFileError(f"{p} already exists (refusing to replace a key)")
                p.unlink()
        key = Ed25519PrivateKey.generate()
        _write_new(
            priv_path,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            0o600,
        )
        os.chmod(priv_path, 0o600)  # a umask cannot widen it, but be explicit
        _write_new(
            pub_path,
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
            0o644,
        )
    except OSError as e:
        raise KeyFileError(f"cannot write keys to {out}: {e.strerror or e}") from None
    return priv_path, pub_path


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read {what} {path}: {e.strerror or e}") from None


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """The Ed25519 private key in a PEM file (unencrypted PKCS#8)."""
    path = Path(path)
    data = _read(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise KeyFileError(f"{path} is not an unencrypted PEM private key") from None
    except Exception:  # cryptography raises UnsupportedAlgorithm and friends for odd keys
        raise KeyFileError(f"{path} holds an unsupported private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} is not an Ed25519 private key")
    return key


def _public_from_pem(block: bytes, path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(block)
    except Exception:
        raise KeyFileError(f"{path} holds a public key that cannot be read") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} holds a public key that is not Ed25519")
    return key


def load_public_keys(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Ed25519PublicKey]:
    """Trusted public keys from PEM files; each file may hold several `PUBLIC KEY` blocks.

    `paths` is one path, an iterable of paths, or a `:`-separated string (LORAFARM_TRUST).
    Raises KeyFileError when a file is unreadable, holds no public key, or none is given.
    """
    if isinstance(paths, str):
        items: list[str | os.PathLike] = [p for p in paths.split(":") if p]
    elif isinstance(paths, os.PathLike):
        items = [paths]
    else:
        items = list(paths)
    if not items:
        raise KeyFileError("no trusted public key given")
    keys: list[Ed25519PublicKey] = []
    for item in items:
        path = Path(item)
        data = _read(path, "public key")
        blocks = []
        pos = 0
        while (start := data.find(_PEM_BEGIN, pos)) >= 0:
            end = data.find(_PEM_END, start)
            if end < 0:
                break
            pos = end + len(_PEM_END)
            blocks.append(data[start:pos] + b"\n")
        if not blocks:
            raise KeyFileError(f"{path} holds no PEM public key (BEGIN PUBLIC KEY)")
        keys.extend(_public_from_pem(b, path) for b in blocks)
    return keys


def sign(private_key: Ed25519PrivateKey, data: bytes) -> bytes:
    return private_key.sign(data)


def signed_by(
    signature: bytes, data: bytes, trusted_keys: Iterable[Ed25519PublicKey]
) -> Ed25519PublicKey | None:
    """The trusted key that made `signature` over `data`, or None."""
    for key in trusted_keys:
        try:
            key.verify(signature, data)
            return key
        except InvalidSignature:
            continue
    return None
