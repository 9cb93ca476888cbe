"""The real model's demo adapters (lorafarm.demo_adapters) and how `lorafarm up` chooses its model:
cheap checks; the trained adapters are checked against PEFT in tests/e2e/test_real_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafarm.demo_adapters import DEMO_ADAPTERS, QA
from lorafarm.errors import CliError


def test_every_training_answer_shows_its_behaviour():
    for a in DEMO_ADAPTERS:
        for _, en, fr in QA:
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
