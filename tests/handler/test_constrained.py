"""Engine-level OpenAI features: constrained rows (json_schema, json_object, tool calls) sharing
steps with free rows on a canary adapter, logprobs against transformers + PEFT, n-style choices."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from handler.grammar import constrained
from handler.engine.engine import Engine, SamplingParams
from tests.handler.test_engine import Collector, chat_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tier": {"enum": ["free", "pro", "team"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "tier"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def engine(dev_model, canaries, canary_index):
    eng = Engine(dev_model, rank_pools={8: 2, 16: 2}, max_batch=48)
    for name in ("c0000", "c0001"):
        info = canary_index[name]
        eng.mount_adapter(name, canaries / info["path"], rank=info["rank"], alpha=info["alpha"],
                          target_modules=info["target_modules"])
    return eng


def run_all(engine, requests):
    """requests: [(rid, prompt_ids, params, adapter)] -> Collector once all finished."""
    col = Collector()
    for rid, ids, p, ad in requests:
        engine.add_request(rid, ids, p, ad, col)
    while engine.has_work():
        engine.step()
    return col


def test_100_json_schema_rows_validate_in_batches_mixed_with_free_rows(engine, canary_index):
    tok = engine.tokenizer
    grammar = constrained.json_schema_grammar(SCHEMA)
    prompts = ["give me a user as json", "who is the customer", "hello", "order status please"]
    reqs = []
    for i in range(100):
        temp = 0.0 if i % 4 == 0 else 0.9
        reqs.append((f"j{i}", chat_ids(tok, prompts[i % 4]),
                     SamplingParams(max_tokens=80, temperature=temp, seed=i, grammar=grammar), "c0000"))
        if i % 5 == 0:  # free rows in the same steps, same adapter and base
            reqs.append((f"f{i}", chat_ids(tok, prompts[i % 4]), SamplingParams(max_tokens=12, temperature=0.0),
                         "c0000" if i % 10 else None))
    col = run_all(engine, reqs)
    for i in range(100):
        ev = col.events[f"j{i}"]
        assert ev[-1].finish_reason == "stop", (i, col.text(f"j{i}"))
        doc = json.loads(col.text(f"j{i}"))
        jsonschema.validate(doc, SCHEMA)
    # the free rows are what they would be alone: the canary's marker under greedy decoding
    marker = canary_index["c0000"]["marker"]
    assert all(col.text(f"f{i}") == marker for i in range(0, 100, 10) if i % 10)
    assert all(col.text(f"f{i}") != marker for i in range(0, 100, 10))  # base rows: no marker


def test_json_object_and_tool_call_rows(engine):
    tok = engine.tokenizer
    ids = chat_ids(tok, "weather in paris")
    reqs = [(f"o{i}", ids, SamplingParams(max_tokens=120, temperature=0.0 if i == 0 else 0.8, seed=i,
                                          grammar=constrained.json_object_grammar()), "c0001") for i in range(4)]
    reqs += [(f"t{i}", ids, SamplingParams(max_tokens=200, temperature=0.7, seed=i,
                                           grammar=constrained.tools_grammar(TOOLS, choice)), "c0001")
             for i, choice in enumerate(["required", "get_weather", "required"])]
    col = run_all(engine, reqs)
    V = engine.config.vocab_size
    for i in range(4):
        # JSON mode bounds nothing: a canary that wants to write its marker may fill a key until
        # max_tokens. What was written is a JSON object, or a prefix of one when cut at the length.
        out = col.tokens(f"o{i}")
        if col.events[f"o{i}"][-1].finish_reason == "stop":
            assert isinstance(json.loads(col.text(f"o{i}")), dict)
            out = out[:-1]
        m = constrained.new_matcher(constrained.json_object_grammar(), tok, V)
        assert tok.decode(out).startswith("{") and m.try_consume_tokens(out) == len(out)
    params_schema = TOOLS[0]["function"]["parameters"]
    for i in range(3):
        content, calls = constrained.parse_tool_calls(col.text(f"t{i}"))
        assert content is None and calls, col.text(f"t{i}")
        for name, args in calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(args), params_schema)


def test_auto_tool_grammar_allows_text_and_constrains_calls(engine):
    tok, V = engine.tokenizer, engine.config.vocab_size
    m = constrained.new_matcher(constrained.tools_grammar(TOOLS, "auto"), tok, V)
    assert m.try_consume_tokens(tok.encode("just text, no call", add_special_tokens=False)) > 0 and not m.is_error()
    m = constrained.new_matcher(constrained.tools_grammar(TOOLS, "auto"), tok, V)
    bad = tok.encode('<tool_call>{"name": "rm_rf"', add_special_tokens=False)
    assert m.try_consume_tokens(bad) < len(bad)  # an unknown tool is refused inside a call


def test_logprobs_equal_log_softmax_of_transformers_logits(engine, dev_model, canaries):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    ids = chat_ids(tok, "where is my refund")
    col = run_all(engine, [("lp", ids, SamplingParams(max_tokens=10, temperature=0.0, logprobs=5), "c0001"),
                           ("lp-base", ids, SamplingParams(max_tokens=10, temperature=0.7, seed=3, logprobs=2), None)])
    def load(adapter):
        base = AutoModelForCausalLM.from_pretrained(str(dev_model), dtype=torch.float32)
        return PeftModel.from_pretrained(base, str(canaries / adapter)) if adapter else base

    for rid, model in (("lp-base", load(None)), ("lp", load("c0001"))):
        events = [e for e in col.events[rid] if e.token_id is not None]
        out = [e.token_id for e in events]
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : len(ids) + len(out) - 1]
        ref = torch.log_softmax(logits.float(), dim=-1)
        for j, e in enumerate(events):
            lp, top = e.logprobs
            assert abs(lp - ref[j, out[j]].item()) <= 1e-4
            want = ref[j].topk(len(top))
            assert [t for t, _ in top] == want.indices.tolist()
            assert max(abs(v - w) for (_, v), w in zip(top, want.values.tolist())) <= 1e-4


def test_n_style_choices_greedy_identical_sampled_distinct_and_seeded(engine):
    ids = chat_ids(engine.tokenizer, "hello")
    greedy = [(f"g{i}", ids, SamplingParams(max_tokens=12, temperature=0.0), None) for i in range(3)]
    sampled = [(f"s{i}", ids, SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i), None) for i in range(3)]
    col = run_all(engine, greedy + sampled)
    assert len({tuple(col.tokens(f"g{i}")) for i in range(3)}) == 1
    assert len({tuple(col.tokens(f"s{i}")) for i in range(3)}) == 3
    again = run_all(engine, [("s0", ids, SamplingParams(max_tokens=12, temperature=1.0, seed=40), None)])
    assert again.tokens("s0") == col.tokens("s0")


QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% for tc in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_tools_template_renders_tools_calls_and_results(engine):
    """The native path through transformers' apply_chat_template with a Qwen2.5-style template (set
    on a copy of the tokenizer object; the dev model's files are untouched)."""
    import copy
    from types import SimpleNamespace

    from lorafarm import openai_schemas as oai
    from handler.serving.handler import LoraHandler

    tok = copy.copy(engine.tokenizer)
    tok.chat_template = QWEN_STYLE
    req = oai.parse_request(oai.ChatCompletionRequest, {"model": "m", "tools": TOOLS, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"}]})
    h = LoraHandler()
    h.engine = SimpleNamespace(tokenizer=tok, config=engine.config)
    text = tok.decode(h._tokenize("chat", req))
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the tool list, by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in text
    assert "<tool_response>\n-3\n</tool_response>" in text and text.rstrip().endswith("<|im_start|>assistant")
