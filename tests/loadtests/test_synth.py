"""Synthetic adapters: valid PEFT folders (our validator and PEFT itself load them), seeded bytes,
finite outputs on the dev model."""

import json

import pytest

from archives.basehash import read_base_config
from archives.peft_dir import read_peft_dir
from loadtests.synth import synth_specs, write_synth_adapter


def test_specs_cycle_ranks_and_module_sets():
    specs = synth_specs(9, [8, 16, 32], "mixed")
    assert [s.rank for s in specs] == [8, 16, 32] * 3
    sets = {(s.rank, len(s.target_modules)) for s in specs}
    assert sets == {(r, n) for r in (8, 16, 32) for n in (7, 4, 3)}  # every rank meets all/attention/mlp
    assert {len(s.target_modules) for s in synth_specs(4, [8], "attn")} == {4}
    assert [s.name for s in specs[:2]] == ["synth-00000", "synth-00001"]


def test_written_adapter_passes_the_registry_checks(tmp_path, dev_model):
    config = read_base_config(dev_model)
    a = write_synth_adapter(config, synth_specs(3, [8, 16, 32], "mixed")[2], tmp_path / "a")
    info = read_peft_dir(a, config)
    assert (info.rank, info.alpha) == (32, 64.0)
    assert len(info.target_modules) == 7
    b = write_synth_adapter(config, synth_specs(3, [8, 16, 32], "mixed")[2], tmp_path / "b")
    assert read_peft_dir(b, config).content_checksum == info.content_checksum  # same seed, same bytes
    other = synth_specs(3, [8, 16, 32], "mixed", seed=1)[2]
    assert read_peft_dir(write_synth_adapter(config, other, tmp_path / "c"), config).content_checksum != info.content_checksum


def test_peft_loads_it_and_outputs_stay_finite(tmp_path, dev_model):
    torch = pytest.importorskip("torch")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = read_base_config(dev_model)
    folder = write_synth_adapter(config, synth_specs(1, [32], "all")[0], tmp_path / "a", str(dev_model))
    assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(dev_model, dtype=torch.float32)
    ids = torch.arange(2, 40).unsqueeze(0)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, folder)
        tuned = model(input_ids=ids).logits
    assert torch.isfinite(tuned).all()
    delta = (tuned - plain).abs().max().item()
    assert 0 < delta < 10 * plain.abs().max().item()  # the adapter changes outputs, the base dominates
