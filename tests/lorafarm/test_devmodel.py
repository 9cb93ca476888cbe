import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafarm.cli import main
from lorafarm.dev.model import SIZES


def _digests(folder: Path) -> dict[str, str]:
    # dot files are caches other code keeps beside a checkpoint (e.g. the base-model hash)
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if not p.name.startswith(".")
    }


def test_dev_model_loads_in_transformers_and_generates(dev_model):
    tok = AutoTokenizer.from_pretrained(dev_model)
    model = AutoModelForCausalLM.from_pretrained(dev_model)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA on
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = enc["input_ids"]
    assert tok.decode(ids[0]).endswith("<|start|>assistant\n")
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 or out[0, -1].item() == tok.eos_token_id
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    # output layer scaled up: logits spread by several units, not rounding noise
    assert model(ids).logits[0, -1].std().item() > 1.0


def test_same_seed_same_bytes_other_seed_differs(tmp_path, dev_model):
    assert main(["devmodel", "--out", str(tmp_path / "a")]) == 0
    a = _digests(tmp_path / "a")
    assert a == _digests(dev_model)
    assert main(["devmodel", "--out", str(tmp_path / "b"), "--seed", "1"]) == 0
    b = _digests(tmp_path / "b")
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_small_size_is_realistic_ratio(tmp_path):
    s = SIZES["small"]
    assert 2.5 <= s.intermediate_size / s.hidden_size <= 2.8
    main(["devmodel", "--out", str(tmp_path / "s"), "--size", "small"])
    size_mb = (tmp_path / "s" / "model.safetensors").stat().st_size / 1e6
    assert 10 < size_mb < 100
    cfg = AutoModelForCausalLM.from_pretrained(tmp_path / "s", dtype=torch.float32).config
    assert cfg.hidden_size == s.hidden_size


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "huge"], "unknown size"),
        (["--out-nonempty"], "not empty"),
        (["--out-file"], "not a directory"),
        (["--out-unwritable"], "No such file"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, argv, message):
    out = tmp_path / "out"
    if argv == ["--out-nonempty"]:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        argv = []
    elif argv == ["--out-file"]:
        out.write_text("a file")
        argv = []
    elif argv == ["--out-unwritable"]:
        out = Path("/proc/lorafarm-no-such/dir")
        argv = []
    proc = subprocess.run(
        [sys.executable, "-m", "lorafarm", "devmodel", "--out", str(out), *argv],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    if out.is_dir():
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dir left behind
