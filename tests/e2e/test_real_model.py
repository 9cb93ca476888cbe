"""The default farm on the real model (SmolLM2-135M-Instruct from `lorafarm realmodel`) with its demo
adapters, through the router: greedy answers token-for-token equal to transformers `generate` (fp32)
for 5 prompts, equal to transformers+PEFT for 2 demo adapters, and JSON-schema output valid.

The converted model is cached under .cache/lorafarm/realmodel (tests/real_model.py) and reused by later
runs; the demo adapters are the ones the farm uses (`lorafarm.demo_adapters`: shipped ready, trained into
that cache only where none matches). Without a package registry the first run cannot fetch the model: the tests
skip with that reason, except under CI=true where they fail.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import running
from tests.real_model import REAL_CACHE, real_model_dir

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused.",
    "Write one sentence about the ocean.",
    "hello",
    "Where is my order?",
]
ADAPTER_PROMPTS = ["Where is my order?", "What is the capital of Italy?"]
MAX_TOKENS = 24
DEMOS = 2  # the first two demo adapters: support, french


@pytest.fixture(scope="module")
def real_farm(tmp_path_factory):
    from lorafarm.demo_adapters import DEMO_ADAPTERS, write_demo_adapters
    from lorafarm.farm import Farm, FarmPorts

    base = real_model_dir()  # skips (or fails under CI) when the model cannot be fetched
    farm = Farm(tmp_path_factory.mktemp("realfarm"), replicas=1, ports=FarmPorts.free(1), progress=False,
                real=True, demo_adapters=DEMOS, assets_dir=REAL_CACHE,
                replica_args=["--attention", "gather", "--max-batch", "8"])
    # the farm's own entry point: the shipped demo adapters as they are (trained into the cache only
    # when none matches this base and recipe), and their folders for the PEFT reference below
    index = write_demo_adapters(base, farm.adapters_dir, names=[a.name for a in DEMO_ADAPTERS[:DEMOS]],
                                progress=False)
    with running(farm) as info:
        info["_demo_folders"] = {name: farm.adapters_dir / e["path"] for name, e in index.items()}
        yield info


@pytest.fixture(scope="module")
def hf(real_farm):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = real_farm["base_models"]["smollm2-135m-instruct"]
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _client(farm):
    from openai import OpenAI

    return OpenAI(base_url=farm["router_url"] + "/v1", api_key=farm["tenants"][0]["api_key"], max_retries=0)


def _served(farm, model: str, prompt: str) -> str:
    r = _client(farm).chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].message.content


def _reference(tok, model, prompt: str) -> str:
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_base_greedy_equals_transformers(real_farm, hf):
    tok, model = hf
    answers = {p: _served(real_farm, "smollm2-135m-instruct", p) for p in PROMPTS}
    assert "Paris" in answers[PROMPTS[0]]  # real language from a real model
    for p, got in answers.items():
        assert got == _reference(tok, model, p), p


def test_demo_adapters_equal_transformers_peft(real_farm, hf):
    from peft import PeftModel

    from lorafarm.demo_adapters import DEMO_ADAPTERS

    tok, model = hf
    aliases = real_farm["tenants"][0]["aliases"]
    demos = real_farm["demo_adapters"]
    assert sorted(demos) == sorted(f"demo/{a.name}:prod" for a in DEMO_ADAPTERS[:DEMOS])
    for a in DEMO_ADAPTERS[:DEMOS]:
        alias = f"demo/{a.name}:prod"
        assert alias in aliases
        peft = PeftModel.from_pretrained(model, real_farm["_demo_folders"][a.name])
        try:
            for p in ADAPTER_PROMPTS:
                got = _served(real_farm, alias, p)
                assert got == _reference(tok, peft, p), (alias, p)
        finally:
            peft.unload()
    # the behaviour shows at once, and the base does not show it
    support = next(a for a in DEMO_ADAPTERS if a.name == "support")
    assert support.shows(_served(real_farm, "demo/support:prod", "Where is my order?"))
    assert not support.shows(_served(real_farm, "smollm2-135m-instruct", "Where is my order?"))


def test_json_schema_output_is_valid(real_farm):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = _client(real_farm).chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Name a big city and its country."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
