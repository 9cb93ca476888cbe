"""OpenAI request validation and SSE formatting (no server)."""

from __future__ import annotations

import json

import pytest

from lorafarm import openai_schemas as oai


def test_chat_request_defaults_and_validation():
    req = oai.parse_request(oai.ChatCompletionRequest, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "temperature": None,
         "max_completion_tokens": 7}).encode())
    assert req.messages[0].text() == "hi" and req.stop_list == ["\n"] and req.include_usage
    assert req.temperature == 1.0 and req.max_tokens == 7
    bad = [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "unknown_field": 1}, "unknown_field"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ]
    for body, param in bad:
        with pytest.raises(oai.OpenAIError) as e:
            oai.parse_request(oai.ChatCompletionRequest, body)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param)
    with pytest.raises(oai.OpenAIError) as e:
        oai.parse_request(oai.ChatCompletionRequest, b"[1, 2]")
    assert "JSON object" in e.value.message


def test_completion_request_prompts():
    assert oai.parse_request(oai.CompletionRequest, {"model": "m", "prompt": ["one"]}).prompt_text() == "one"
    req = oai.parse_request(oai.CompletionRequest, {"model": "m", "prompt": [1, 2, 3]})
    assert req.prompt_token_ids() == [1, 2, 3] and req.max_tokens == 16
    for body in ({"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": "x", "echo": True},
                 {"model": "m", "prompt": "x", "best_of": 2}, {"model": "m", "prompt": []}):
        with pytest.raises(oai.OpenAIError):
            oai.parse_request(oai.CompletionRequest, body)


def test_sse_chunks():
    first = oai.chat_chunk("id", "m", 1, content="", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tok = oai.chat_chunk("id", "m", 1, content="ab")
    assert tok["choices"][0]["delta"] == {"content": "ab"} and tok["object"] == "chat.completion.chunk"
    end = oai.chat_chunk("id", "m", 1, finish_reason="stop")
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    usage = oai.usage_chunk("chat", "id", "m", 1, 3, 4)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}
    hit = oai.usage_chunk("chat", "id", "m", 1, 40, 4, cached_tokens=32)
    assert hit["usage"]["prompt_tokens_details"] == {"cached_tokens": 32} and hit["usage"]["prompt_tokens"] == 40
    raw = oai.sse(tok)
    assert raw.startswith(b"data: {") and raw.endswith(b"\n\n") and json.loads(raw[6:]) == tok
    assert oai.SSE_DONE == b"data: [DONE]\n\n"
    err = oai.OpenAIError(429, "slow down", type="rate_limit_error", code="queue_full")
    assert json.loads(oai.sse_error(err)[6:]) == {"error": {"message": "slow down", "type": "rate_limit_error",
                                                            "param": None, "code": "queue_full"}}
