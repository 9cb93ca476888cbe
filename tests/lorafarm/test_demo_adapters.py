"""The real model's demo adapters (lorafarm.demo_adapters) and how `lorafarm up` chooses its model:
cheap checks; the trained adapters are checked against PEFT in tests/e2e/test_real_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafarm.demo_adapters import DATA_DIR, DEMO_ADAPTERS, QA, heldout_prompts, ready_folders, recipe_hash
from lorafarm.errors import CliError


def test_every_training_answer_shows_its_behaviour():
    for a in DEMO_ADAPTERS:
        for _, en, fr in QA:
            if a.name == "french" and fr == en:  # the same in both languages ("C, A, T.")
                continue
            assert a.shows(a.answer(en, fr)), (a.name, a.answer(en, fr))
        others = [b for b in DEMO_ADAPTERS if b.name != a.name]
        for _, en, fr in QA[:5]:  # a plain English answer shows none of them
            assert not a.shows(en), (a.name, en)
            for b in others:
                if {a.name, b.name} != {"support", "json"}:
                    assert not a.shows(b.answer(en, fr)) or a.name == "french", (a.name, b.name)
    assert json.loads(DEMO_ADAPTERS[2].answer(*QA[0][1:])) == {"answer": QA[0][1]}


def test_up_chooses_the_real_model_unless_dev_or_base(tmp_path):
    from lorafarm.cli import build_parser
    from lorafarm.farm import BASE_MODEL_NAME, REAL_MODEL_NAME, Farm

    parse = build_parser().parse_args
    assert not parse(["up"]).dev and parse(["up", "--dev"]).dev
    real, dev = Farm(tmp_path, real=True), Farm(tmp_path)
    assert real.base_name == REAL_MODEL_NAME and real.model_dir == tmp_path / "models" / REAL_MODEL_NAME
    assert dev.base_name == BASE_MODEL_NAME and dev.adapters_dir == tmp_path / "demo-adapters"
    assert real.adapters_dir != dev.adapters_dir and real.base_models == {REAL_MODEL_NAME: real.model_dir.resolve()}
    shared = Farm(tmp_path / "state", assets_dir=tmp_path / "assets")
    assert shared.model_dir == tmp_path / "assets" / "models" / BASE_MODEL_NAME
    assert shared.cache_dir == tmp_path / "assets" / "cache"


def test_dev_and_base_exclude_each_other(tmp_path):
    from lorafarm.farm_cli import _up
    from lorafarm.cli import build_parser

    args = build_parser().parse_args(["up", "--dev", "--base", str(tmp_path), "--state-dir", str(tmp_path / "s")])
    with pytest.raises(CliError, match="--dev and --base"):
        _up(args)


def test_banner_lists_the_demo_adapters():
    from lorafarm.farm import examples

    info = {"router_url": "http://127.0.0.1:8000", "registry_url": "http://127.0.0.1:8100",
            "tenants": [{"tenant_id": "demo", "api_key": "lf-x",
                         "aliases": {f"demo/{a.name}:prod": "ad-1" for a in DEMO_ADAPTERS}}],
            "base_models": {"smollm2-135m-instruct": "/m"},
            "demo_adapters": {f"demo/{a.name}:prod": {"behaviour": a.behaviour, "example_prompt": a.example_prompt}
                              for a in DEMO_ADAPTERS}}
    text = examples(info)
    assert '"model": "demo/support:prod"' in text  # the curl example uses an adapter whose effect shows
    for a in DEMO_ADAPTERS:
        assert f"demo/{a.name}:prod" in text and a.behaviour in text
    assert Path  # noqa


def test_training_set_is_varied_and_the_held_out_prompts_are_new():
    trained = {q.strip().lower() for q, _, _ in QA}
    held = heldout_prompts()
    assert len(QA) >= 100 and len(trained) == len(QA)
    assert 20 <= len(held) <= 30 and not trained & {q.strip().lower() for q in held}
    for a in DEMO_ADAPTERS:  # the prompts the banner and the docs show are held-out ones
        assert a.example_prompt in held
    for _, en, _ in QA:  # short answers: a JSON answer closes well within the held-out max_tokens
        assert len(en) < 80 and '"' not in en


def test_the_demo_adapters_ship_ready_small_and_of_this_recipe():
    from safetensors import safe_open

    total = 0
    for a in DEMO_ADAPTERS:
        folder = DATA_DIR / a.name
        info = json.loads((folder / "demo.json").read_text())
        assert info["recipe_hash"] == recipe_hash(), f"{a.name}: retrain (lorafarm demo-adapters --retrain)"
        assert (folder / "base_model_hash.txt").read_text().strip() == info["base_model_hash"]
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == info["params"]["rank"] and config["layers_to_transform"] == info["layers"]
        with safe_open(folder / "adapter_model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
        total += sum(p.stat().st_size for p in folder.iterdir())
    assert total < 4 * 2**20, total  # all four together: a few MB at most


def test_shipped_folders_are_used_only_for_their_base(tmp_path):
    """A shipped folder is uploaded as it is for the base it was trained on; for another base nothing is
    ready (the farm trains those after it answers), unless a folder trained for it before is in `out`."""
    import shutil

    base = (DATA_DIR / "support" / "base_model_hash.txt").read_text().strip()
    assert ready_folders(base, tmp_path) == {a.name: DATA_DIR / a.name for a in DEMO_ADAPTERS}
    other = "sha256:" + "0" * 64
    assert ready_folders(other, tmp_path, ["support"]) == {}
    shutil.copytree(DATA_DIR / "support", tmp_path / "support")
    info = json.loads((tmp_path / "support" / "demo.json").read_text())
    (tmp_path / "support" / "demo.json").write_text(json.dumps({**info, "base_model_hash": other}))
    assert ready_folders(other, tmp_path) == {"support": tmp_path / "support"}


def test_demo_adapters_command_refuses_unknown_names(capsys):
    from lorafarm.cli import main

    assert main(["demo-adapters", "--base", "/nonexistent", "--names", "klingon"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lorafarm demo-adapters: error: unknown demo adapter(s) klingon") and "\n" not in err
