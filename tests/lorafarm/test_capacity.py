"""`lorafarm capacity` and slot sizing by memory: the seed's numbers, pinned."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lorafarm import capacity as cap
from lorafarm.cli import build_parser, main

SEVEN_B = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "architectures": ["LlamaForCausalLM"]}


def test_seed_numbers():
    r = cap.compute()
    assert r.adapter_values == 39_976_960
    assert round(r.adapter_bytes / 1e6) == 80
    assert round(r.all_adapters_bytes / 1e9) == 400
    assert round(r.merged_copies_bytes / 1e12) == 70
    assert r.kv_bytes_per_token == 524_288
    assert round(r.kv_total_bytes / 1e9, 1) == 33.6
    assert round(r.gpu_left_bytes / 1e9, 1) == 28.4
    assert r.adapters_fit == 355
    assert r.slot_cache_adapters == 250 and round(r.slot_cache_bytes / 1e9) == 20
    assert f"{r.decode_replicas:.1f}" == "15.6" and f"{r.prefill_replicas:.1f}" == "3.8"
    assert f"{r.replicas_needed:.1f}" == "19.4" and r.replicas == 26
    assert r.placements == 10_000 and r.adapters_per_replica == 385
    assert round(r.host_ram_per_replica_bytes / 1e9) == 31
    assert round(r.load_s["ram"], 3) == 0.008 and round(r.load_s["disk"], 3) == 0.04
    assert round(r.load_s["remote"], 2) == 0.4 and round(r.load_s["base"]) == 14
    assert r.cost_per_h == 65 and r.dedicated_cost_per_h == 12_500
    assert r.merged_replica_threshold_tokens_per_s == 640


def test_inputs_change_the_answer():
    """GQA shrinks the KV cache and k/v adapter matrices; rank 64 makes an adapter 4x (320 MB)."""
    gqa = cap.compute(cap.CapacityInputs(model=cap.ModelDims(kv_heads=8)))
    assert gqa.kv_bytes_per_token == 524_288 // 4
    assert gqa.adapter_values < 39_976_960 and gqa.adapters_fit > 355
    r64 = cap.compute(cap.CapacityInputs(workload=cap.Workload(rank=64)))
    assert round(r64.adapter_bytes / 1e6) == 320
    busy = cap.compute(cap.CapacityInputs(workload=cap.Workload(rate=80)))
    assert busy.replicas == 51  # 38.75 x 1.3 = 50.4 -> 51


def test_cli_table_and_json(capsys):
    assert main(["capacity"]) == 0
    out = capsys.readouterr().out
    for text in ("39,976,960", "80 MB", "524,288", "33.6 GB", "355", "15.6", "3.8", "19.4", "26", "385",
                 "31 GB", "65 USD", "12,500 USD"):
        assert text in out, text
    assert main(["capacity", "--json", "--adapters", "1000"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["inputs"]["workload"]["adapters"] == 1000 and data["placements"] == 2000
    assert data["replicas"] == 26


def test_cli_bad_input_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "lorafarm", "capacity", "--batch", "0"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--batch" in proc.stderr


def test_slots_for_budget_seed_cap():
    """The seed's 20 GB cap at 7B shapes: 250 rank-16 slots; a mix splits the budget by share."""
    dims = cap.ModelDims()
    assert cap.slots_for_budget(20 * 10**9, {16: 1}, dims) == {16: 250}
    mixed = cap.slots_for_budget(20 * 10**9, {8: 1, 16: 2, 32: 1}, dims)
    assert mixed == {8: 125, 16: 125, 32: 31}  # 5, 10, 5 GB
    assert cap.pools_bytes(mixed, dims) <= 20 * 10**9
    with pytest.raises(ValueError):
        cap.slots_for_budget(10**9, {}, dims)


def _replica_args(base, *extra):
    return build_parser().parse_args(["replica", "--base", str(base), "--dtype", "bfloat16", *extra])


def test_replica_derives_pools_from_budget(tmp_path, monkeypatch):
    from handler.cli import build_config
    from lorafarm.errors import CliError

    monkeypatch.delenv("LORAFARM_REGISTRY_URL", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(SEVEN_B))
    cfg = build_config(_replica_args(tmp_path, "--lora-memory-bytes", "20GB", "--rank-mix", "16:1",
                                     "--rank-limit", "16"))
    assert cfg.rank_pools == {16: 250} and cfg.prewarm == 250
    even = build_config(_replica_args(tmp_path, "--lora-memory-bytes", "20GB", "--rank-limit", "32"))
    assert set(even.rank_pools) == {8, 16, 32}
    for bad in (["--lora-memory-bytes", "1MB"], ["--rank-mix", "16:1"],
                ["--lora-memory-bytes", "20GB", "--rank-mix", "64:1", "--rank-limit", "16"],
                ["--lora-memory-bytes", "20GB", "--rank-pools", "16:4"]):
        with pytest.raises(CliError):
            build_config(_replica_args(tmp_path, *bad))


def test_budget_matches_the_engine_allocation(dev_model):
    """The arithmetic agrees with what the real multi-LoRA stacks allocate at the tiny model's shapes."""
    import torch

    from handler.cli import pools_from_budget
    from handler.model.lora import ModelLoRA
    from handler.model.runner import ModelConfig, load_hf_config

    budget = 3 * 10**6
    pools = pools_from_budget(dev_model, budget, {8: 1, 16: 1}, rank_limit=16, dtype="float32")
    lora = ModelLoRA(ModelConfig.from_hf(load_hf_config(dev_model)), pools, torch.float32, torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for layer in lora.layers for g in layer.values()
                    for t in [*g.A, *(b for bs in g.B for b in bs)])
    dims = cap.ModelDims.from_hf_config(json.loads((dev_model / "config.json").read_text()), dtype_bytes=4)
    # the stacks hold the derived slots plus the empty slot 0 of each pool
    assert allocated == sum((s + 1) * cap.adapter_bytes(dims, r) for r, s in pools.items())
    assert cap.pools_bytes(pools, dims) <= budget
