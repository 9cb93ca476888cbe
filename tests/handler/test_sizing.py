"""The replica sizes its KV cache and adapter slots from the model and the machine (handler/serving/sizing.py)
when `--kv-cache-bytes` / `--slots` / `--rank-pools` / `--lora-memory-bytes` do not say."""

from __future__ import annotations

import json

from handler.serving.sizing import GiB, MiB, size_replica, slot_bytes, weights_bytes

SMOLLM2 = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}
LLAMA8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 131072, "tie_word_embeddings": False}


def test_weights_bytes_counts_parameters():
    assert abs(weights_bytes(SMOLLM2, 1) - 134.5e6) < 1e6  # SmolLM2-135M
    assert abs(weights_bytes(LLAMA8B, 1) - 8.03e9) < 0.02e9


def test_smollm2_on_a_cpu_box_is_small():
    s = size_replica(SMOLLM2, dtype_bytes=4, device="cpu", max_batch=32, rank_limit=64, memory_bytes=24 * GiB)
    assert s.kv_cache_bytes <= 300 * MiB  # was 2 GiB
    # was 8 slots in each of the four pools (860 MB); 2% of the RAM gives ranks 16 and 32 room too
    assert s.rank_pools == {8: 8, 16: 8, 32: 5, 64: 1}
    assert s.lora_bytes == sum(n * slot_bytes(SMOLLM2, r, 4) for r, n in s.rank_pools.items()) <= 24 * GiB // 50
    assert s.weights_bytes + s.kv_cache_bytes + s.lora_bytes < 1.5 * GiB
    small_box = size_replica(SMOLLM2, dtype_bytes=4, device="cpu", max_batch=32, rank_limit=64, memory_bytes=4 * GiB)
    assert small_box.kv_cache_bytes < s.kv_cache_bytes  # 2% of the RAM
    # on a small box 40% of the weights is more than 2% of the RAM: the pools fill the smallest ranks
    assert small_box.rank_pools == {8: 8, 16: 1, 32: 1, 64: 1}
    assert small_box.lora_bytes <= 0.4 * small_box.weights_bytes


def test_rank_limit_bounds_the_pools():
    s = size_replica(SMOLLM2, dtype_bytes=4, device="cpu", max_batch=32, rank_limit=16, memory_bytes=24 * GiB)
    assert set(s.rank_pools) == {8, 16}


def test_gpu_sizes_from_the_device_memory():
    s = size_replica(LLAMA8B, dtype_bytes=2, device="cuda", max_batch=32, rank_limit=64, memory_bytes=80 * 10**9)
    spare = int(80e9 * 0.9) - s.weights_bytes
    assert s.kv_cache_bytes == 32 * 2048 * 2 * 32 * 8 * 128 * 2  # all 32 requests at 2,048 tokens fit
    assert s.lora_bytes <= max(256 * MiB, spare // 10) and s.rank_pools[8] == 8


def test_flags_override_and_defaults_apply(tmp_path, dev_model):
    from handler.cli import build_config
    from lorafarm.cli import build_parser

    base = tmp_path / "smol"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(SMOLLM2))
    parse = build_parser().parse_args
    cfg = build_config(parse(["replica", "--base", str(base), "--device", "cpu"]))
    assert cfg.rank_pools == size_replica(SMOLLM2, dtype_bytes=4, device="cpu", max_batch=cfg.engine.max_batch,
                                          rank_limit=64).rank_pools and cfg.slots == 8  # this machine's RAM
    assert 64 * MiB <= cfg.engine.kv_cache_bytes <= 300 * MiB
    cfg = build_config(parse(["replica", "--base", str(base), "--device", "cpu", "--slots", "3",
                              "--kv-cache-bytes", "1GiB"]))
    assert cfg.rank_pools is None and cfg.slots == 3 and cfg.engine.kv_cache_bytes == GiB
    cfg = build_config(parse(["replica", "--base", str(dev_model), "--device", "cpu"]))
    assert cfg.rank_pools == {8: 8, 16: 8, 32: 8, 64: 8}  # the dev model: the old default
