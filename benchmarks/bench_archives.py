"""Archive costs at the seed's adapter size, and the local store against a plain file copy.

The adapter has the shapes of the seed's example: a 7B Llama (32 layers, hidden 4096, MLP 11008,
32 heads), rank 16 on all seven projections, bfloat16, random values: 39,976,960 values, 80 MB.
No 14 GB base is needed: build and verify take the base hash as a string and a matching config
dict, so the shape checks run exactly as they would against the real base.

    make bench PYTEST_ARGS='-k archives'
    # or: .venv/bin/python -m pytest benchmarks/bench_archives.py --benchmark-only --benchmark-enable
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from archives.build import build_archive
from archives.extract import extract_archive
from archives.keys import generate_keypair, load_private_key, load_public_keys
from archives.peft_dir import ATTENTION_MODULES, MLP_MODULES, module_shapes
from archives.store import open_store
from archives.verify import verify_archive

RANK = 16
BASE_CONFIG = {  # Llama-2-7B's config.json, the fields the shape check reads
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
}
BASE_HASH = "sha256:" + "7b" * 32  # stands in for base_model_hash() of the 14 GB checkpoint
ROUNDS = 5
MB = 1e6


@pytest.fixture(scope="module")
def seed_adapter(tmp_path_factory):
    """A PEFT adapter folder with the seed's 80 MB rank-16 shapes, plus a signing key."""
    folder = tmp_path_factory.mktemp("seed-adapter")
    shapes = module_shapes(BASE_CONFIG)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(BASE_CONFIG["num_hidden_layers"]):
        for module in ATTENTION_MODULES + MLP_MODULES:
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g).to(torch.bfloat16)
    assert sum(t.numel() for t in tensors.values()) == 39_976_960  # the seed's count
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 32, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(ATTENTION_MODULES + MLP_MODULES), "task_type": "CAUSAL_LM",
    }))  # fmt: skip
    priv, pub = generate_keypair(folder.parent / f"{folder.name}-keys")
    return folder, load_private_key(priv), load_public_keys(pub)


def _build(seed_adapter, out: Path):
    folder, private, _ = seed_adapter
    return build_archive(
        folder,
        out,
        private_key=private,
        tenant_id="bench",
        base_model_hash=BASE_HASH,
        base_config=BASE_CONFIG,
    )


@pytest.fixture(scope="module")
def seed_archive(seed_adapter, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seed-archive") / "seed.lar"
    _build(seed_adapter, out)
    return out


def _throughput(benchmark, nbytes: int) -> None:
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["MB_per_s"] = round(nbytes / benchmark.stats.stats.mean / MB, 1)


@pytest.mark.benchmark(group="archive-80MB")
def test_build(benchmark, seed_adapter, tmp_path):
    """Validate (shapes vs base config), hash, sign, write the tar, fsync, rename."""
    manifest = benchmark.pedantic(
        _build, args=(seed_adapter, tmp_path / "a.lar"), rounds=ROUNDS, iterations=1
    )
    assert manifest.rank == RANK
    _throughput(benchmark, (tmp_path / "a.lar").stat().st_size)


@pytest.mark.benchmark(group="archive-80MB")
def test_verify(benchmark, seed_adapter, seed_archive):
    """Signature, both checksums, config and tensor-shape checks, base hash comparison."""
    keys = seed_adapter[2]
    manifest = benchmark.pedantic(
        verify_archive, args=(seed_archive, keys), kwargs={"base_model_hash": BASE_HASH, "base_config": BASE_CONFIG},
        rounds=ROUNDS, iterations=1,
    )  # fmt: skip
    assert manifest.rank == RANK
    _throughput(benchmark, seed_archive.stat().st_size)


@pytest.mark.benchmark(group="archive-80MB")
def test_extract(benchmark, seed_adapter, seed_archive, tmp_path):
    """verify + copy the four members out, re-hashed, fsynced, renamed."""
    keys = seed_adapter[2]
    benchmark.pedantic(
        extract_archive, args=(seed_archive, tmp_path / "out", keys), kwargs={"base_model_hash": BASE_HASH},
        rounds=ROUNDS, iterations=1,
    )  # fmt: skip
    _throughput(benchmark, seed_archive.stat().st_size)


@pytest.mark.benchmark(group="store-80MB")
def test_store_put(benchmark, seed_archive, tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    benchmark.pedantic(
        lambda: asyncio.run(store.put_file("bench/seed.lar", seed_archive)), rounds=ROUNDS, iterations=1
    )
    assert (tmp_path / "store" / "bench" / "seed.lar").stat().st_size == seed_archive.stat().st_size
    _throughput(benchmark, seed_archive.stat().st_size)


@pytest.mark.benchmark(group="store-80MB")
def test_store_get(benchmark, seed_archive, tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    asyncio.run(store.put_file("bench/seed.lar", seed_archive))
    benchmark.pedantic(
        lambda: asyncio.run(store.get_file("bench/seed.lar", tmp_path / "got.lar")),
        rounds=ROUNDS,
        iterations=1,
    )
    _throughput(benchmark, seed_archive.stat().st_size)


@pytest.mark.benchmark(group="store-80MB")
def test_plain_copy(benchmark, seed_archive, tmp_path):
    """The anchor: shutil.copyfile of the same bytes (no fsync, no rename)."""
    benchmark.pedantic(
        shutil.copyfile, args=(seed_archive, tmp_path / "copy.lar"), rounds=ROUNDS, iterations=1
    )
    _throughput(benchmark, seed_archive.stat().st_size)


def _copy_fsync(src: Path, dest: Path) -> None:
    shutil.copyfile(src, dest)
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.benchmark(group="store-80MB")
def test_plain_copy_fsync(benchmark, seed_archive, tmp_path):
    """The durable anchor: the same copy plus fsync, which put/get also pay."""
    benchmark.pedantic(_copy_fsync, args=(seed_archive, tmp_path / "copy.lar"), rounds=ROUNDS, iterations=1)
    _throughput(benchmark, seed_archive.stat().st_size)
