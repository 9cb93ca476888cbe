"""Hostile and broken archives: each is refused with its specific error, by verify and by extract,
and extraction leaves nothing behind, inside or outside the target folder."""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
import tarfile
from pathlib import Path

import pytest

from archives.basehash import base_model_hash
from archives.errors import (
    ArchiveError,
    BaseMismatchError,
    ChecksumError,
    CorruptArchiveError,
    InvalidAdapterError,
    RankLimitError,
    SignatureError,
    UnsafeArchiveError,
)
from archives.extract import extract_archive
from archives.verify import verify_archive
from tests.archives.tarcraft import (
    Member,
    get,
    read_members,
    replace,
    resigned,
    with_files,
    without,
    write_tar,
)


class _Trap:
    """Unpickling this touches a file: proof that a pickle was (or was not) ever loaded."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def _flip_weight_byte(ms, keys, other, tmp):
    weights = bytearray(get(ms, "adapter_model.safetensors"))
    weights[len(weights) - 100] ^= 0x01  # inside the tensor data
    return replace(ms, "adapter_model.safetensors", bytes(weights))


def _edit_manifest_after_signing(ms, keys, other, tmp):
    manifest = json.loads(get(ms, "manifest.json"))
    manifest["tenant_id"] = "mallory"
    return replace(ms, "manifest.json", json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def _pickle_weights(ms, keys, other, tmp):
    payload = pickle.dumps(_Trap(tmp / "PICKLE_WAS_LOADED"))
    return resigned(with_files(replace(ms, "adapter_model.safetensors", payload)), keys.private)


def _config_and_manifest_rank_4(ms, keys, other, tmp):
    config = json.loads(get(ms, "adapter_config.json"))
    config["r"] = 4
    ms = replace(ms, "adapter_config.json", json.dumps(config).encode())
    return resigned(with_files(ms), keys.private, rank=4)


ATTACKS = {
    # name: (make members, expected error, words in the message)
    "flipped weight byte": (_flip_weight_byte, ChecksumError, "sha256"),
    "manifest edited after signing": (_edit_manifest_after_signing, SignatureError, "trusted key"),
    "signed by an untrusted key": (
        lambda ms, k, o, t: resigned(ms, o.private),
        SignatureError,
        "trusted key",
    ),
    "no signature": (lambda ms, k, o, t: without(ms, "manifest.sig"), SignatureError, "not signed"),
    "truncated signature": (
        lambda ms, k, o, t: replace(ms, "manifest.sig", get(ms, "manifest.sig")[:32]),
        SignatureError,
        "64-byte",
    ),
    "extra member": (
        lambda ms, k, o, t: ms + [Member("run_me.py", b"import os")],
        UnsafeArchiveError,
        "unexpected member",
    ),
    "dot-dot member": (lambda ms, k, o, t: ms + [Member("../x", b"escaped")], UnsafeArchiveError, "'..'"),
    "nested dot-dot member": (
        lambda ms, k, o, t: [Member("a/../../x", b"escaped")] + ms,
        UnsafeArchiveError,
        "'..'",
    ),
    "absolute path member": (
        lambda ms, k, o, t: ms + [Member(str(t / "abs"), b"escaped")],
        UnsafeArchiveError,
        "absolute",
    ),
    "symlink member": (
        lambda ms, k, o, t: (
            without(ms, "adapter_model.safetensors")
            + [Member("adapter_model.safetensors", type=tarfile.SYMTYPE, linkname="/etc/passwd")]
        ),
        UnsafeArchiveError,
        "symbolic link",
    ),
    "hardlink member": (
        lambda ms, k, o, t: (
            without(ms, "adapter_config.json")
            + [Member("adapter_config.json", type=tarfile.LNKTYPE, linkname="manifest.json")]
        ),
        UnsafeArchiveError,
        "hard link",
    ),
    "directory member": (
        lambda ms, k, o, t: [Member("adapter_model.safetensors", type=tarfile.DIRTYPE)] + ms,
        UnsafeArchiveError,
        "directory",
    ),
    "device member": (
        lambda ms, k, o, t: ms + [Member("manifest.sig", type=tarfile.CHRTYPE)],
        UnsafeArchiveError,
        "device",
    ),
    "fifo member": (
        lambda ms, k, o, t: [Member("manifest.json", type=tarfile.FIFOTYPE)] + ms,
        UnsafeArchiveError,
        "FIFO",
    ),
    "duplicate member": (
        lambda ms, k, o, t: ms + [Member("manifest.json", get(ms, "manifest.json"))],
        UnsafeArchiveError,
        "twice",
    ),
    "oversized member": (
        lambda ms, k, o, t: replace(ms, "adapter_config.json", b" " * (2 * 1024 * 1024)),
        UnsafeArchiveError,
        "limit",
    ),
    "pickle .bin member": (
        lambda ms, k, o, t: (
            without(ms, "adapter_model.safetensors")
            + [Member("adapter_model.bin", pickle.dumps(_Trap(t / "PICKLE_WAS_LOADED")))]
        ),
        UnsafeArchiveError,
        "pickle",
    ),
    "pickle bytes named .safetensors (signed)": (_pickle_weights, InvalidAdapterError, "pickle"),
    "manifest rank differs from tensors (signed)": (
        lambda ms, k, o, t: resigned(ms, k.private, rank=4),
        InvalidAdapterError,
        "rank",
    ),
    "config and manifest rank differ from tensors (signed)": (
        _config_and_manifest_rank_4,
        InvalidAdapterError,
        "rank 16",
    ),
    "missing weights (signed)": (
        lambda ms, k, o, t: without(ms, "adapter_model.safetensors"),
        CorruptArchiveError,
        "no adapter_model.safetensors",
    ),
    "manifest not JSON (signed)": (
        lambda ms, k, o, t: replace(
            replace(ms, "manifest.json", b"\x00not json"), "manifest.sig", k.private.sign(b"\x00not json")
        ),
        CorruptArchiveError,
        "manifest.json",
    ),
}


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_is_refused_and_nothing_is_written(attack, good_archive, keys, other_keys, tmp_path):
    make, error, words = ATTACKS[attack]
    evil = write_tar(tmp_path / "evil.lar", make(read_members(good_archive), keys, other_keys, tmp_path))
    before = _tree(tmp_path)

    with pytest.raises(error, match=words):
        verify_archive(evil, [keys.public])
    dest = tmp_path / "work" / "out"
    with pytest.raises(error, match=words):
        extract_archive(evil, dest, [keys.public])

    assert not dest.exists()
    assert _tree(tmp_path) == before  # verification failed before anything was created
    assert not (tmp_path / "work" / "x").exists() and not (tmp_path / "x").exists()


def test_extract_into_existing_folder_leaves_it_as_it_was(good_archive, keys, tmp_path):
    members = read_members(good_archive)
    evil = write_tar(tmp_path / "evil.lar", _flip_weight_byte(members, keys, None, tmp_path))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(ChecksumError):
        extract_archive(evil, dest, [keys.public])
    assert _tree(dest) == {"keep.txt"}


def test_base_hash_mismatch(good_archive, keys, dev_model_b):
    other_base = base_model_hash(dev_model_b)
    with pytest.raises(BaseMismatchError, match="built for base"):
        verify_archive(good_archive, [keys.public], base_model_hash=other_base)


def test_rank_limit(good_archive, keys, tmp_path):
    with pytest.raises(RankLimitError, match="rank 16, above the limit 8"):
        extract_archive(good_archive, tmp_path / "out", [keys.public], max_rank=8)
    assert not (tmp_path / "out").exists()


def test_no_trusted_keys(good_archive):
    with pytest.raises(SignatureError, match="no trusted public keys"):
        verify_archive(good_archive, [])


def test_compressed_archive(good_archive, keys, tmp_path):
    gz = tmp_path / "a.lar.gz"
    gz.write_bytes(gzip.compress(good_archive.read_bytes()))
    with pytest.raises(CorruptArchiveError, match="gzip-compressed"):
        verify_archive(gz, [keys.public])


@pytest.mark.parametrize("keep", [0, 100, 512, 1536, 4000])
def test_truncated_archive(good_archive, keys, tmp_path, keep):
    cut = tmp_path / "cut.lar"
    cut.write_bytes(good_archive.read_bytes()[:keep])
    with pytest.raises(ArchiveError) as info:
        extract_archive(cut, tmp_path / "out", [keys.public])
    assert isinstance(info.value, CorruptArchiveError | SignatureError)
    assert not (tmp_path / "out").exists()


def test_missing_archive(tmp_path, keys):
    with pytest.raises(CorruptArchiveError, match="cannot read archive"):
        verify_archive(tmp_path / "nope.lar", [keys.public])


def test_pickle_is_never_loaded(good_archive, keys, tmp_path):
    evil = write_tar(tmp_path / "evil.lar", _pickle_weights(read_members(good_archive), keys, None, tmp_path))
    with pytest.raises(InvalidAdapterError):
        extract_archive(evil, tmp_path / "out", [keys.public])
    assert not (tmp_path / "PICKLE_WAS_LOADED").exists()
    # the trap works: loading it would have created the file
    pickle.loads(get(read_members(evil), "adapter_model.safetensors"))
    assert (tmp_path / "PICKLE_WAS_LOADED").exists()


def test_member_checksum_size_mismatch(good_archive, keys, tmp_path):
    """Weights with one byte appended: the size check names the sizes."""
    ms = read_members(good_archive)
    evil = write_tar(
        tmp_path / "evil.lar", replace(ms, "adapter_config.json", get(ms, "adapter_config.json") + b" ")
    )
    with pytest.raises(ChecksumError, match="bytes but the signed manifest says"):
        verify_archive(evil, [keys.public])
    assert hashlib.sha256(get(ms, "adapter_config.json")).hexdigest()  # the original is intact
