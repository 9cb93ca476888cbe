"""Manifest canonical bytes, identifiers, digests and key files."""

from __future__ import annotations

import hashlib
import json
import stat
from datetime import datetime, timedelta, timezone

import pytest

from archives.digest import file_sha256
from archives.errors import CorruptArchiveError, KeyFileError
from archives.ids import adapter_id_for
from archives.keys import generate_keypair, key_id, load_private_key, load_public_keys
from archives.manifest import Manifest

H = "sha256:" + "ab" * 32


def _manifest(**changes) -> Manifest:
    fields = dict(
        adapter_id="ad-0123456789abcdef0123", tenant_id="acme", version=2, base_model_hash=H, rank=16,
        alpha=32, target_modules=["v_proj", "q_proj"], created_at=datetime(2026, 5, 1, 12, 0, 0, 123, tzinfo=timezone.utc),
        files={"adapter_config.json": {"sha256": H, "size": 10}, "adapter_model.safetensors": {"sha256": H, "size": 20}},
    )  # fmt: skip
    return Manifest(**{**fields, **changes})


def test_canonical_bytes():
    m = _manifest()
    raw = m.canonical_bytes()
    assert b" " not in raw and b"\n" not in raw
    data = json.loads(raw)
    assert list(data) == sorted(data)
    assert data["created_at"] == "2026-05-01T12:00:00Z"
    assert data["target_modules"] == ["q_proj", "v_proj"]
    assert Manifest.from_bytes(raw) == m and Manifest.from_bytes(raw).canonical_bytes() == raw
    # the same instant in another zone signs the same bytes
    other = _manifest(created_at=datetime(2026, 5, 1, 14, 0, 0, tzinfo=timezone(timedelta(hours=2))))
    assert other.canonical_bytes() == raw


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"[]", "invalid"),
        (b"{", "invalid|not valid JSON"),
        (b"\xff", "invalid|not valid JSON"),
        (b'{"adapter_id": 1}', "invalid"),
    ],
)
def test_manifest_from_bad_bytes(raw, words):
    with pytest.raises(CorruptArchiveError, match=words):
        Manifest.from_bytes(raw)


@pytest.mark.parametrize(
    "change",
    [
        {"rank": "16"},
        {"rank": True},
        {"version": 0},
        {"tenant_id": "ACME"},
        {"extra": 1},
        {"files": {"adapter_config.json": {"sha256": H, "size": 1}}},
        {"format_version": 2},
    ],  # fmt: skip
)
def test_manifest_schema_is_strict(change):
    data = json.loads(_manifest().canonical_bytes())
    data.update(change)
    with pytest.raises(CorruptArchiveError):
        Manifest.from_bytes(json.dumps(data).encode())


def test_adapter_id_and_digest(tmp_path):
    assert adapter_id_for("acme", H) == "ad-" + hashlib.sha256(f"acme\0{H}".encode()).hexdigest()[:20]
    p = tmp_path / "f"
    p.write_bytes(b"x" * 3_000_000)
    assert file_sha256(p) == "sha256:" + hashlib.sha256(b"x" * 3_000_000).hexdigest()


def test_keygen_files(tmp_path):
    priv, pub = generate_keypair(tmp_path / "k")
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    private, public = load_private_key(priv), load_public_keys(pub)[0]
    assert key_id(private.public_key()) == key_id(public)
    with pytest.raises(KeyFileError, match="already exists"):
        generate_keypair(tmp_path / "k")
    generate_keypair(tmp_path / "k", overwrite=True)
    assert key_id(load_public_keys(pub)[0]) != key_id(public)


def test_trust_bundles_and_env_style_paths(tmp_path):
    _, pub_a = generate_keypair(tmp_path / "a")
    _, pub_b = generate_keypair(tmp_path / "b")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(pub_a.read_bytes() + pub_b.read_bytes())
    ids = {key_id(k) for k in load_public_keys(f"{pub_a}:{pub_b}")}
    assert len(ids) == 2
    assert {key_id(k) for k in load_public_keys([bundle])} == ids


def test_bad_key_files(tmp_path):
    priv, pub = generate_keypair(tmp_path)
    with pytest.raises(KeyFileError, match="not an unencrypted PEM private key"):
        load_private_key(pub)
    with pytest.raises(KeyFileError, match="no PEM public key"):
        load_public_keys([priv])
    with pytest.raises(KeyFileError, match="cannot read"):
        load_public_keys([tmp_path / "missing.pem"])
    with pytest.raises(KeyFileError, match="no trusted public key"):
        load_public_keys([])
    garbage = tmp_path / "g.pem"
    garbage.write_text("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    with pytest.raises(KeyFileError, match="cannot be read"):
        load_public_keys(garbage)
    # an RSA key is not an Ed25519 key
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    rsa_pem = tmp_path / "rsa.pem"
    rsa_pem.write_bytes(
        rsa_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(KeyFileError, match="not an Ed25519"):
        load_private_key(rsa_pem)
