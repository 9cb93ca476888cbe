"""The base-model hash: content over tensors, independent of sharding, cached outside the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from safetensors.numpy import load_file, save_file

from archives.basehash import CACHE_ENV, base_model_hash, cache_path, compute_base_model_hash
from archives.errors import InvalidBaseModelError


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "hash-cache"))


@pytest.fixture
def base_copy(dev_model, tmp_path):
    """A private copy of the dev model's checkpoint (tests modify it)."""
    out = tmp_path / "base"
    out.mkdir()
    shutil.copy(dev_model / "model.safetensors", out / "model.safetensors")
    shutil.copy(dev_model / "config.json", out / "config.json")
    return out


def test_format_and_different_bases(dev_model, dev_model_b):
    a, b = base_model_hash(dev_model), base_model_hash(dev_model_b)
    assert a.startswith("sha256:") and len(a) == 7 + 64
    assert a != b


def test_cache_is_written_used_and_invalidated(base_copy):
    fresh = base_model_hash(base_copy)
    assert sorted(p.name for p in base_copy.iterdir()) == ["config.json", "model.safetensors"]  # nothing written there
    cache = cache_path(base_copy)
    assert json.loads(cache.read_text())["base_model_hash"] == fresh

    # The cache answers while the files are unchanged: a planted value comes back.
    planted = json.loads(cache.read_text())
    planted["base_model_hash"] = "sha256:" + "0" * 64
    cache.write_text(json.dumps(planted))
    assert base_model_hash(base_copy) == "sha256:" + "0" * 64
    assert base_model_hash(base_copy, use_cache=False) == fresh

    # A changed mtime (same size) invalidates it.
    st = os.stat(base_copy / "model.safetensors")
    os.utime(base_copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert base_model_hash(base_copy) == fresh


def test_unwritable_cache_is_skipped(base_copy):
    cache_path(base_copy).parent.parent.mkdir(parents=True, exist_ok=True)
    cache_path(base_copy).parent.write_text("a file, not a folder")  # the cache cannot be written
    assert base_model_hash(base_copy) == compute_base_model_hash(base_copy)


def test_damaged_cache_is_ignored(base_copy):
    expected = compute_base_model_hash(base_copy)
    cache_path(base_copy).parent.mkdir(parents=True, exist_ok=True)
    cache_path(base_copy).write_text("{not json")
    assert base_model_hash(base_copy) == expected


def test_sharding_does_not_change_the_hash(base_copy, tmp_path):
    tensors = load_file(base_copy / "model.safetensors")
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({n: tensors[n] for n in names[::2]}, sharded / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, sharded / "model-00002-of-00002.safetensors")
    assert compute_base_model_hash(sharded) == compute_base_model_hash(base_copy)


def test_one_changed_weight_changes_the_hash(base_copy):
    before = compute_base_model_hash(base_copy)
    data = bytearray((base_copy / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (base_copy / "model.safetensors").write_bytes(bytes(data))
    assert compute_base_model_hash(base_copy) != before


def test_renamed_tensor_changes_the_hash(base_copy, tmp_path):
    tensors = load_file(base_copy / "model.safetensors")
    name = sorted(tensors)[0]
    tensors["renamed." + name] = tensors.pop(name)
    other = tmp_path / "other"
    other.mkdir()
    save_file(tensors, other / "model.safetensors")
    assert compute_base_model_hash(other) != compute_base_model_hash(base_copy)


def test_invalid_bases(tmp_path, base_copy):
    with pytest.raises(InvalidBaseModelError, match="does not exist"):
        base_model_hash(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidBaseModelError, match="no \\*.safetensors"):
        base_model_hash(empty)
    (empty / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(InvalidBaseModelError, match="not a safetensors file"):
        base_model_hash(empty)
    # the same tensor in two shards
    shutil.copy(base_copy / "model.safetensors", base_copy / "model-2.safetensors")
    with pytest.raises(InvalidBaseModelError, match="appears in both"):
        base_model_hash(base_copy)
