"""Acceptance: canary adapters built into archives, stored in both backends, fetched, verified and
extracted give back exactly the trained tensors."""

from __future__ import annotations

import json
import tarfile
from datetime import datetime, timezone

import pytest
import torch
from safetensors.torch import load_file

from archives.build import build_archive
from archives.extract import extract_archive
from archives.ids import adapter_id_for
from archives.manifest import MEMBER_NAMES
from archives.peft_dir import read_peft_dir
from archives.store import open_store
from archives.verify import verify_archive

# ranks 8/16/32 x module sets all/attention/mlp (see lorafarm.dev.adapters.canary_spec)
CANARIES = [f"c{i:04d}" for i in range(9)]


@pytest.fixture(params=["file", "s3"])
async def store(request, tmp_path):
    if request.param == "file":
        s = open_store(f"file://{tmp_path / 'store'}")
    else:
        s = open_store(
            f"s3://{request.getfixturevalue('s3_bucket')}/archives",
            endpoint_url=request.getfixturevalue("s3_endpoint"),
        )
    yield s
    await s.close()


async def test_canaries_round_trip(store, few_canaries, keys, base_hash, base_config, tmp_path):
    canaries, canary_index = few_canaries
    built = {}
    for name in CANARIES:
        lar = tmp_path / "built" / f"{name}.lar"
        manifest = build_archive(
            canaries / name, lar, private_key=keys.private, tenant_id="acme", version=3,
            base_model_hash=base_hash, base_config=base_config,
        )  # fmt: skip
        built[name] = manifest
        await store.put_file(f"acme/{manifest.adapter_id}.lar", lar)

    assert await store.list("acme/") == sorted(f"acme/{m.adapter_id}.lar" for m in built.values())
    for name, manifest in built.items():
        spec = canary_index[name]
        fetched = tmp_path / "fetched" / f"{name}.lar"
        await store.get_file(store.key_for(store.uri_for(f"acme/{manifest.adapter_id}.lar")), fetched)

        verified = verify_archive(
            fetched, [keys.public], base_model_hash=base_hash, max_rank=64, base_config=base_config
        )
        assert verified == manifest
        assert (verified.rank, verified.alpha) == (spec["rank"], spec["alpha"])
        assert verified.target_modules == sorted(spec["target_modules"])

        out = tmp_path / "extracted" / name
        extract_archive(fetched, out, [keys.public], base_model_hash=base_hash)
        assert sorted(p.name for p in out.iterdir()) == sorted(MEMBER_NAMES)
        original, restored = (
            load_file(canaries / name / "adapter_model.safetensors"),
            load_file(out / "adapter_model.safetensors"),
        )
        assert original.keys() == restored.keys()
        for key in original:
            assert torch.equal(original[key], restored[key]), key
        assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
            (canaries / name / "adapter_config.json").read_text()
        )


def test_manifest_contents(good_archive, canary_dir, few_canaries, keys, base_hash):
    canary_index = few_canaries[1]
    manifest = verify_archive(good_archive, [keys.public])
    info = read_peft_dir(canary_dir)
    assert manifest.adapter_id == adapter_id_for("acme", info.content_checksum)
    assert manifest.tenant_id == "acme" and manifest.version == 1 and manifest.format_version == 1
    assert manifest.base_model_hash == base_hash
    assert manifest.rank == canary_index["c0001"]["rank"]
    assert (
        manifest.files["adapter_model.safetensors"].size
        == (canary_dir / "adapter_model.safetensors").stat().st_size
    )
    with tarfile.open(good_archive) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == list(MEMBER_NAMES)
        assert all(m.isreg() for m in members)
        assert tar.extractfile("manifest.json").read() == manifest.canonical_bytes()


def test_build_is_deterministic_and_atomic(canary_dir, keys, base_hash, tmp_path):
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    a, b = tmp_path / "a.lar", tmp_path / "b.lar"
    for out in (a, b):
        build_archive(
            canary_dir,
            out,
            private_key=keys.private,
            tenant_id="acme",
            base_model_hash=base_hash,
            created_at=when,
        )
    assert a.read_bytes() == b.read_bytes()  # Ed25519 signatures are deterministic too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lar", "b.lar"]  # no temp files left


def test_same_files_same_id_other_tenant_other_id(canary_dir, keys, base_hash, tmp_path):
    ids = [
        build_archive(
            canary_dir,
            tmp_path / f"{i}.lar",
            private_key=keys.private,
            tenant_id=t,
            base_model_hash=base_hash,
        ).adapter_id
        for i, t in enumerate(["acme", "acme", "globex"])
    ]
    assert ids[0] == ids[1] != ids[2]


def test_explicit_adapter_id_and_key_path(canary_dir, keys, base_hash, tmp_path):
    m = build_archive(
        canary_dir, tmp_path / "x.lar", private_key=keys.private_path, tenant_id="acme",
        adapter_id="ad-0123456789abcdef0123", version=7, base_model_hash=base_hash,
    )  # fmt: skip
    assert (m.adapter_id, m.version) == ("ad-0123456789abcdef0123", 7)
    assert verify_archive(tmp_path / "x.lar", [keys.public_path]) == m  # PEM paths work as trusted keys
