"""Validation of PEFT adapter folders before anything is built from them."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from archives.build import build_archive
from archives.errors import InvalidAdapterError
from archives.peft_dir import module_shapes, read_peft_dir


@pytest.fixture
def adapter(canary_dir, tmp_path):
    """A private copy of canary c0001 (rank 16, all modules)."""
    out = tmp_path / "adapter"
    shutil.copytree(canary_dir, out)
    return out


def _edit_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _edit_tensors(folder, fn):
    tensors = load_file(folder / "adapter_model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "adapter_model.safetensors")


def test_every_canary_is_valid(few_canaries, base_config):
    canaries, canary_index = few_canaries  # every rank and module set
    for name, spec in canary_index.items():
        info = read_peft_dir(canaries / spec["path"], base_config)
        assert (info.rank, info.alpha, info.target_modules) == (
            spec["rank"],
            spec["alpha"],
            sorted(spec["target_modules"]),
        )
        assert info.layers == list(range(base_config["num_hidden_layers"])), name


def test_module_shapes_of_dev_base(base_config):
    shapes = module_shapes(base_config)
    assert shapes["q_proj"] == (128, 128) and shapes["k_proj"] == (
        128,
        64,
    )  # 4 heads, 2 kv heads, head_dim 32
    assert shapes["down_proj"] == (344, 128)


def test_pickle_bin_is_refused(adapter, tmp_path, keys, base_hash):
    tensors = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(tensors, adapter / "adapter_model.bin")
    with pytest.raises(InvalidAdapterError, match="adapter_model.bin.*pickle weights are refused"):
        read_peft_dir(adapter)
    with pytest.raises(InvalidAdapterError, match="pickle"):
        build_archive(
            adapter, tmp_path / "x.lar", private_key=keys.private, tenant_id="acme", base_model_hash=base_hash
        )
    assert not (tmp_path / "x.lar").exists()


def test_pickle_renamed_to_safetensors_is_refused(adapter):
    (adapter / "adapter_model.safetensors").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(InvalidAdapterError, match="pickle"):
        read_peft_dir(adapter)
    torch.save({"a": torch.zeros(2)}, adapter / "adapter_model.safetensors")  # zip-based torch.save
    with pytest.raises(InvalidAdapterError, match="pickle"):
        read_peft_dir(adapter)


def test_shapes_checked_against_base(adapter, base_config):
    wider = {**base_config, "hidden_size": 256, "head_dim": 64}
    with pytest.raises(InvalidAdapterError, match="another base"):
        read_peft_dir(adapter, wider)
    fewer_layers = {**base_config, "num_hidden_layers": 2}
    with pytest.raises(InvalidAdapterError, match="the base has 2"):
        read_peft_dir(adapter, fewer_layers)
    read_peft_dir(adapter)  # without a base config only internal consistency is checked


CONFIG_CASES = {
    "not LORA": ({"peft_type": "IA3"}, "only 'LORA'"),
    "r zero": ({"r": 0}, "r must be a positive integer"),
    "r float": ({"r": 16.0}, "r must be a positive integer"),
    "alpha negative": ({"lora_alpha": -1}, "lora_alpha"),
    "target regex": ({"target_modules": ".*proj"}, "is a pattern"),
    "unknown module": ({"target_modules": ["q_proj", "lm_head"]}, "lm_head not supported"),
    "dora": ({"use_dora": True}, "DoRA"),
    "rslora": ({"use_rslora": True}, "rsLoRA"),
    "rank pattern": ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
    "modules to save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bias": ({"bias": "all"}, "bias 'all'"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_adapter_config(adapter, case):
    changes, words = CONFIG_CASES[case]
    _edit_config(adapter, **changes)
    with pytest.raises(InvalidAdapterError, match=words):
        read_peft_dir(adapter)


def test_config_rank_differs_from_tensors(adapter, base_config):
    _edit_config(adapter, r=8)
    with pytest.raises(InvalidAdapterError, match="declared rank is 8"):
        read_peft_dir(adapter, base_config)


def test_config_not_json(adapter):
    (adapter / "adapter_config.json").write_text("{")
    with pytest.raises(InvalidAdapterError, match="not valid JSON"):
        read_peft_dir(adapter)


def test_unexpected_tensor(adapter):
    _edit_tensors(
        adapter, lambda t: t.__setitem__("base_model.model.model.embed_tokens.weight", torch.zeros(4, 4))
    )
    with pytest.raises(InvalidAdapterError, match="unexpected tensor"):
        read_peft_dir(adapter)


def test_missing_lora_b(adapter):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _edit_tensors(adapter, lambda t: t.pop(key))
    with pytest.raises(InvalidAdapterError, match="layer 0 q_proj has no lora_B"):
        read_peft_dir(adapter)


def test_module_missing_from_tensors(adapter):
    _edit_tensors(adapter, lambda t: [t.pop(k) for k in list(t) if ".down_proj." in k])
    with pytest.raises(InvalidAdapterError, match="no tensors for target modules down_proj"):
        read_peft_dir(adapter)


def test_tensor_for_untargeted_module(adapter):
    _edit_config(adapter, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with pytest.raises(InvalidAdapterError, match="not in target_modules"):
        read_peft_dir(adapter)


def test_integer_dtype_refused(adapter):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _edit_tensors(adapter, lambda t: t.__setitem__(key, t[key].to(torch.int32)))
    with pytest.raises(InvalidAdapterError, match="dtype I32"):
        read_peft_dir(adapter)


def test_missing_files(adapter, tmp_path):
    with pytest.raises(InvalidAdapterError, match="does not exist"):
        read_peft_dir(tmp_path / "nope")
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(InvalidAdapterError, match="no adapter_config.json"):
        read_peft_dir(adapter)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidAdapterError, match="no adapter_model.safetensors"):
        read_peft_dir(adapter)


def test_bad_build_arguments(adapter, keys, base_hash, tmp_path):
    for kwargs, words in [
        ({"tenant_id": "Not A Slug"}, "tenant_id"),
        ({"adapter_id": "ad-xyz"}, "adapter_id"),
        ({"version": 0}, "version"),
        ({"base_model_hash": "md5:abc"}, "base_model_hash"),
    ]:
        args = {"private_key": keys.private, "tenant_id": "acme", "base_model_hash": base_hash, **kwargs}
        with pytest.raises(InvalidAdapterError, match=words):
            build_archive(adapter, tmp_path / "x.lar", **args)
    assert not (tmp_path / "x.lar").exists()
