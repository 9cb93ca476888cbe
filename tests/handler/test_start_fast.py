"""A replica starts without transformers (issue 36): its config read from config.json
(handler.model.runner.json_config) and its tokenizer on the `tokenizers` library with the chat template
rendered as transformers renders it (handler.model.tokenizer.FastTokenizer) give exactly what
transformers' AutoConfig and AutoTokenizer give; a folder they do not cover goes to transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? <b>&</b> \"quoted\" é 世界 🤖"}],
    [{"role": "user", "content": "weather in Paris?", "name": None},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
    [{"role": "user", "content": "  leading and trailing  \n\n"}, {"role": "assistant", "content": "ok",
                                                                  "reasoning_content": "think"}],
]
TEXTS = ["Hello world!", "  spaces  and\ttabs\n\nnewlines ", "héllo 世界 🤖", "<|im_start|>user\nhi<|im_end|>",
         "<|begin|>x<|end|>", ""]


def _models(dev_model) -> list[Path]:
    out = [dev_model]
    real = REPO / ".cache" / "lorafarm" / "realmodel" / "models" / "smollm2-135m-instruct"
    if (real / "tokenizer.json").is_file():  # the real model where a test run converted it already
        out.append(real)
    return out


def test_fast_tokenizer_is_transformers_token_for_token(dev_model):
    from transformers import AutoTokenizer

    from handler.model.tokenizer import FastTokenizer, load_tokenizer

    for d in _models(dev_model):
        ours, theirs = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
        assert isinstance(ours, FastTokenizer), d
        assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
        assert (len(ours), ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, ours.special_tokens_map) == (
            len(theirs), theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id, theirs.special_tokens_map)
        assert ours.chat_template == theirs.chat_template
        for text in TEXTS:
            for special in (True, False):
                ids = theirs.encode(text, add_special_tokens=special)
                assert ours.encode(text, add_special_tokens=special) == ids, (d, text)
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        every = [[i] for i in range(len(theirs))]
        assert ours.batch_decode(every, clean_up_tokenization_spaces=False) == theirs.batch_decode(
            every, clean_up_tokenization_spaces=False)
        for conv in CONVERSATIONS:
            for gen in (True, False):
                for kw in ({}, {"tools": TOOLS}):
                    text = theirs.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False, **kw)
                    assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False, **kw) == text
                    assert ours.apply_chat_template(conv, add_generation_prompt=gen, **kw) == \
                        theirs.encode(text, add_special_tokens=False)


def test_tokenizer_options_it_does_not_cover_go_to_transformers(dev_model, tmp_path):
    from handler.model.tokenizer import FastTokenizer, load_tokenizer

    d = tmp_path / "model"
    shutil.copytree(dev_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    tok = load_tokenizer(d)
    assert not isinstance(tok, FastTokenizer)
    assert type(tok).__module__.startswith("transformers")


def test_config_from_json_is_autoconfigs(dev_model, tmp_path):
    from transformers import AutoConfig

    from handler.model.runner import ModelConfig, json_config, load_hf_config

    for d in _models(dev_model):
        assert json_config(d) is not None
        assert ModelConfig.from_hf(load_hf_config(d)) == ModelConfig.from_hf(AutoConfig.from_pretrained(str(d)))
    # a config.json leaving a field to transformers' per-model defaults: AutoConfig's
    d = tmp_path / "model"
    d.mkdir()
    cfg = json.loads((dev_model / "config.json").read_text())
    del cfg["rms_norm_eps"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert json_config(d) is None
    assert type(load_hf_config(d)).__module__.startswith("transformers")


def test_replica_start_does_not_import_transformers(dev_model, tmp_path):
    """The whole start (config, weights, tokenizer, engine, adapter cache, grammar workers) in a fresh
    interpreter: transformers (and PEFT) never imported."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from handler.serving.app import ReplicaService
        from handler.serving.config import REPLICA_ENGINE, Limits, ReplicaConfig

        cfg = ReplicaConfig(base_dir=Path({str(dev_model)!r}), replica_id="rf", model_name="dev-tiny",
                            disk_dir=Path({str(tmp_path / "disk")!r}),
                            engine=REPLICA_ENGINE.replace(kv_cache_bytes=8 * 1024 * 1024, device="cpu"),
                            limits=Limits(default_max_tokens=8))

        async def main():
            svc = ReplicaService(cfg)
            await svc.start()
            assert svc.ready and svc.handler.grammar_pool is not None
            print("IMPORTED", sorted(m for m in ("transformers", "peft") if m in sys.modules))
            await svc.stop()

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "IMPORTED []" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("kwargs", [{"continue_final_message": True}, {"return_assistant_tokens_mask": True}])
def test_what_it_does_not_render_is_refused_not_guessed(dev_model, kwargs):
    from handler.model.tokenizer import FastTokenizer

    with pytest.raises(NotImplementedError):
        FastTokenizer.load(dev_model).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, **kwargs)
