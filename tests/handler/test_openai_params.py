"""Request parameters -> engine parameters, the unsupported-parameter audit, tool prompts and the
tool-call stream splitter (no server)."""

from __future__ import annotations

import json

import pytest

from lorafarm import openai_schemas as oai
from handler.grammar.constrained import ToolCallStream, parse_tool_calls
from handler.serving.handler import GenerationRequest, LoraHandler
from handler.grammar.tools_prompt import render_messages, template_supports_tools

MSG = [{"role": "user", "content": "x"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**kw):
    return oai.parse_request(oai.ChatCompletionRequest, {"model": "m", "messages": MSG, **kw})


def greq(req, n=1):
    return GenerationRequest(kind="chat", body=req, model="m", adapter_id=None, prompt_ids=[1], max_tokens=5,
                             stop=[], stream=False, include_usage=False, tier="gpu", n=n)


def test_every_sampling_parameter_reaches_the_engine():
    req = chat(temperature=0.5, top_p=0.9, seed=7, n=3, presence_penalty=0.5, frequency_penalty=-0.25,
               logit_bias={"5": -100, "9": 2.5}, logprobs=True, top_logprobs=4, top_k=20, min_p=0.1,
               repetition_penalty=1.2, stop=["\n"])
    g = greq(req, n=3)
    p0, p2 = LoraHandler.sampling_params(g, 0), LoraHandler.sampling_params(g, 2)
    assert (p0.temperature, p0.top_p, p0.seed, p2.seed) == (0.5, 0.9, 7, 9)
    assert (p0.presence_penalty, p0.frequency_penalty, p0.repetition_penalty) == (0.5, -0.25, 1.2)
    assert dict(p0.logit_bias) == {5: -100.0, 9: 2.5} and p0.logprobs == 4 and (p0.top_k, p0.min_p) == (20, 0.1)
    assert LoraHandler.sampling_params(greq(chat(logprobs=True)), 0).logprobs == 0
    assert LoraHandler.sampling_params(greq(chat()), 0).logprobs is None
    comp = oai.parse_request(oai.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 3, "n": 2})
    assert comp.n_logprobs == 3 and comp.n == 2


@pytest.mark.parametrize("name", sorted(oai.CHAT_UNSUPPORTED))
def test_each_unsupported_chat_parameter_is_named(name):
    with pytest.raises(oai.OpenAIError) as e:
        chat(**{name: {"x": 1} if name != "modalities" else ["audio"]})
    assert (e.value.status, e.value.code, e.value.param) == (400, "unsupported_parameter", name)


def test_no_op_values_pass_and_completion_audit():
    chat(store=False, modalities=["text"], service_tier="auto", metadata={}, user="u", prompt_cache_key="k")
    for extra in ({"echo": True}, {"best_of": 2}, {"suffix": "x"}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(oai.OpenAIError) as e:
            oai.parse_request(oai.CompletionRequest, {"model": "m", "prompt": "x", **extra})
        assert e.value.code == "unsupported_parameter" and e.value.param == next(iter(extra))


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, None),  # tool_choice without tools
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, None),
    ({"top_logprobs": 2}, None),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
])
def test_bad_feature_combinations_are_400(body, param):
    with pytest.raises(oai.OpenAIError) as e:
        chat(**body)
    assert e.value.status == 400 and (param is None or e.value.param == param), e.value.param


def test_tool_modes():
    assert chat(tools=[TOOL]).tool_mode == "auto"
    assert chat(tools=[TOOL], tool_choice="none").tool_mode is None
    assert chat(tools=[TOOL], tool_choice="required").tool_mode == "required"
    assert chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}).tool_mode == "f"


def test_tool_call_stream_holds_back_calls_and_passes_text():
    text = 'Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", ' \
           '"arguments": {}}</tool_call>'
    ids = iter(["c1", "c2"])
    ts = ToolCallStream(lambda: next(ids))
    content, calls = "", []
    for ch in text:  # one character at a time, as a stream may cut anywhere
        c, k = ts.feed(ch)
        assert "<" not in c
        content, calls = content + c, calls + k
    c, k = ts.close()
    content, calls = content + c, calls + k
    assert content == "Let me check. "
    assert calls == [(0, "c1", "f", '{"a": 1}'), (1, "c2", "g", "{}")]
    assert parse_tool_calls(text) == ("Let me check.", [("f", '{"a": 1}'), ("g", "{}")])
    assert parse_tool_calls("a < b") == ("a < b", [])


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_tool_prompts_native_and_fallback():
    history = chat(tools=[TOOL], messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    native = _Tok("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert template_supports_tools(native) and not template_supports_tools(_Tok("{{ messages }}"))
    msgs, kw = render_messages(native, history)
    assert kw["tools"][0]["function"]["name"] == "f"
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and msgs[2]["tool_call_id"] == "call_1"
    msgs, kw = render_messages(_Tok("{{ messages }}"), history)
    assert kw == {} and msgs[0]["role"] == "system" and '"name": "f"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    msgs, _ = render_messages(_Tok("{{ messages }}"), chat(tools=[TOOL], tool_choice="none"))
    assert msgs == [{"role": "user", "content": "x"}]  # tool_choice none: no tools shown
    assert json.loads(json.dumps(msgs))
