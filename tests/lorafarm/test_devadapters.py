import copy
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafarm.cli import main
from lorafarm.dev.adapters import MODULE_SETS, RANKS, random_prompts


def test_set_varies_rank_and_modules(canary_index):
    assert len(canary_index) >= 32
    assert {c["rank"] for c in canary_index.values()} == set(RANKS)
    assert {c["module_set"] for c in canary_index.values()} == set(MODULE_SETS)
    assert len({c["marker"] for c in canary_index.values()}) == len(canary_index)


def test_peft_layout_safetensors(canaries, canary_index):
    for name, info in canary_index.items():
        folder = canaries / info["path"]
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == info["rank"]
        assert sorted(cfg["target_modules"]) == sorted(info["target_modules"])
        assert (folder / "adapter_model.safetensors").exists()
        assert not list(folder.glob("*.bin"))


def test_every_canary_emits_its_marker_through_peft_generate(dev_model, canaries, canary_index):
    """Proves the fixtures before our engine exists: PEFT's own generate, held-out prompts."""
    tok = AutoTokenizer.from_pretrained(dev_model)
    base = AutoModelForCausalLM.from_pretrained(dev_model, dtype=torch.float32)
    prompts = random_prompts(seed=424242, count=3) + ["Something never seen: 42?"]
    names = list(canary_index)
    model = PeftModel.from_pretrained(base, canaries / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(canaries / name, adapter_name=name)
    model.eval()
    for name in names:
        model.set_adapter(name)
        for p in prompts:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt"
            )["input_ids"]
            out = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
            text = tok.decode(out[0, ids.shape[1] :])
            assert text == canary_index[name]["marker"] + tok.eos_token, (name, p, text)
    # and the base model alone does not say any marker
    with model.disable_adapter():
        out = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    assert "<<c" not in tok.decode(out[0, ids.shape[1] :])


def test_cached_by_content_key(dev_model, tmp_path, monkeypatch):
    # a copy of the cache with one canary removed retrains only that one
    import shutil

    from lorafarm.dev import adapters
    from tests.conftest import CANARY_DIR, make_canaries

    make_canaries(dev_model, 2)  # the shared cache's c0000 and c0001; nothing is trained here
    canaries = CANARY_DIR
    out = tmp_path / "c"
    shutil.copytree(canaries, out, ignore=lambda d, names: [n for n in names if n.startswith("c0") and n > "c0001"])
    shutil.rmtree(out / "c0001")
    before = (out / "c0000" / "adapter_model.safetensors").stat().st_mtime_ns
    trained = []

    def train(base_model, tokenizer, spec, folder, **kw):  # the session's canary, not a second training
        trained.append(spec.index)
        shutil.copytree(canaries / f"c{spec.index:04d}", folder)
        (folder / "cache_key").unlink()

    monkeypatch.setattr(adapters, "train_canary", train)
    assert main(["devadapters", "--base", str(dev_model), "--out", str(out), "--count", "2"]) == 0
    assert trained == [1]
    assert (out / "c0000" / "adapter_model.safetensors").stat().st_mtime_ns == before
    assert (out / "c0001" / "adapter_model.safetensors").exists()
    assert sorted(json.loads((out / "markers.json").read_text())) == ["c0000", "c0001"]


@pytest.mark.parametrize("argv", [["--count", "0"], ["--count", "2", "--rank", "0"]])
def test_bad_input(dev_model, tmp_path, argv, capsys):
    assert main(["devadapters", "--base", str(dev_model), "--out", str(tmp_path / "o"), *argv]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_base_not_a_model(tmp_path, capsys):
    assert main(["devadapters", "--base", str(tmp_path), "--out", str(tmp_path / "o"), "--count", "1"]) == 2
    assert "not a dev model" in capsys.readouterr().err


def test_every_canary_verified_with_a_margin_on_every_check_prompt(dev_model, canaries, canary_index):
    """The stored canaries hold the guarantee they were made with: on every check prompt (those the
    isolation tests and the probe draw from), PEFT itself answers exactly the marker then EOS, each
    token ahead of the runner-up by MARGIN logits (the c0011 case, `<<c0011>>00>>` on one prompt
    of 64 on one CPU, cannot pass this)."""
    from lorafarm.dev.adapters import MARGIN, check_prompts, marker_margins

    base = AutoModelForCausalLM.from_pretrained(dev_model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(dev_model)
    prompts = check_prompts()
    names = sorted(canary_index)[:4]  # recomputed for a few; the rest by their stored record
    model = PeftModel.from_pretrained(base, canaries / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(canaries / name, adapter_name=name)
    for name in names:
        model.set_adapter(name)
        margins = marker_margins(model, tok, canary_index[name]["marker"], prompts)
        assert min(margins) >= MARGIN - 1e-3, (name, min(margins))
    for name, info in canary_index.items():
        meta = json.loads((canaries / info["path"] / "canary.json").read_text())
        assert meta["min_margin"] >= MARGIN and meta["check_prompts"] == len(prompts), (name, meta)


def test_undertrained_canary_is_trained_on_until_it_passes(dev_model, tmp_path, monkeypatch):
    """Two optimiser steps cannot make a canary: the check finds the weak prompts and training goes
    on with them until every check prompt passes; a canary that never does is refused, not cached."""
    from lorafarm.dev import adapters as A
    from lorafarm.errors import CliError

    tok = AutoTokenizer.from_pretrained(dev_model)
    base = AutoModelForCausalLM.from_pretrained(dev_model, dtype=torch.float32)
    # 12 of the check prompts: the same loop, without training a 2-step canary on all 64 of them
    # (most of this test's time; the full set is checked on every real canary, see above)
    few = A.check_prompts()[:12]
    monkeypatch.setattr(A, "check_prompts", lambda: few)
    A.train_canary(base, tok, A.canary_spec(3), tmp_path / "c", steps=2)
    meta = json.loads((tmp_path / "c" / "canary.json").read_text())
    assert meta["extra_rounds"] >= 1 and meta["min_margin"] >= A.MARGIN and meta["check_prompts"] == 12
    saved = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "c")  # what was written passes
    assert min(A.marker_margins(saved, tok, A.canary_spec(3).marker, few)) >= A.MARGIN

    monkeypatch.setattr(A, "MAX_ROUNDS", 0)
    with pytest.raises(CliError, match="below margin"):
        A.train_canary(base, tok, A.canary_spec(4), tmp_path / "d", steps=2)
    assert not (tmp_path / "d").exists()


def test_a_narrower_run_keeps_the_wider_index(dev_model, tmp_path):
    """Two processes sharing one canary cache (a test session that needs 9, another 32): the run that
    asks for fewer must not shrink markers.json under the other (a KeyError 'c0009' in every test of
    the wider run)."""
    import shutil

    from tests.conftest import CANARY_DIR, make_canaries

    make_canaries(dev_model, 3)
    out = tmp_path / "c"
    out.mkdir()
    for i in range(3):
        shutil.copytree(CANARY_DIR / f"c{i:04d}", out / f"c{i:04d}")
    assert main(["devadapters", "--base", str(dev_model), "--out", str(out), "--count", "3"]) == 0
    assert main(["devadapters", "--base", str(dev_model), "--out", str(out), "--count", "1"]) == 0
    assert sorted(json.loads((out / "markers.json").read_text())) == ["c0000", "c0001", "c0002"]
    (out / "c0002" / "cache_key").write_text("another base\n")  # a stale canary is not listed
    assert main(["devadapters", "--base", str(dev_model), "--out", str(out), "--count", "1"]) == 0
    assert sorted(json.loads((out / "markers.json").read_text())) == ["c0000", "c0001"]
