"""Fixtures for the archive tests: key pairs, the dev base's hash and config, a built archive."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from archives.basehash import base_model_hash, read_base_config
from archives.build import build_archive
from archives.keys import generate_keypair, load_private_key, load_public_keys

TENANT = "acme"


@dataclass(frozen=True)
class KeyPair:
    private: Ed25519PrivateKey
    public: Ed25519PublicKey
    private_path: Path
    public_path: Path


def _keypair(folder: Path) -> KeyPair:
    priv, pub = generate_keypair(folder)
    return KeyPair(load_private_key(priv), load_public_keys([pub])[0], priv, pub)


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> KeyPair:
    """The trusted signing key (the registry's)."""
    return _keypair(tmp_path_factory.mktemp("trusted-keys"))


@pytest.fixture(scope="session")
def other_keys(tmp_path_factory) -> KeyPair:
    """A key nobody trusts."""
    return _keypair(tmp_path_factory.mktemp("untrusted-keys"))


@pytest.fixture(scope="session")
def base_hash(dev_model: Path) -> str:
    return base_model_hash(dev_model)


@pytest.fixture(scope="session")
def base_config(dev_model: Path) -> dict:
    return read_base_config(dev_model)


@pytest.fixture(scope="session")
def canary_dir(dev_model: Path) -> Path:
    """c0001: rank 16, all seven modules (the shared cache's; only c0000 and c0001 are made for it)."""
    from tests.conftest import CANARY_DIR, make_canaries

    make_canaries(dev_model, 2)
    return CANARY_DIR / "c0001"


@pytest.fixture(scope="session")
def good_archive(tmp_path_factory, canary_dir, keys, base_hash, base_config) -> Path:
    """A valid archive of c0001 signed by `keys`. Tests must not modify it (copy first)."""
    out = tmp_path_factory.mktemp("good") / "c0001.lar"
    build_archive(
        canary_dir, out, private_key=keys.private, tenant_id=TENANT, version=1,
        base_model_hash=base_hash, base_config=base_config,
    )  # fmt: skip
    out.chmod(0o444)
    return out
