"""Issue 35 item 6: 4xx for every malformed text. A lone UTF-16 surrogate anywhere a string is
accepted, and completions token ids that are not integers, are a 400 invalid_request_error at the
router before any replica is tried (the real router in front of stand-in replicas), and at the
replica's schema (lorafarm/openai_schemas.py, which the replica validates with) when it is called
directly. tests/reliability/test_tenant_safety.py sends the same bodies through real processes."""

from __future__ import annotations

import json

import httpx
import pytest

from lorafarm import openai_schemas as oai
from lorafarm.embeddings import EmbeddingsRequestError, parse_embeddings
from tests.router.conftest import router_farm

pytestmark = pytest.mark.timeout(60)

USER = {"role": "user", "content": "hi"}
LONE = "a\ud800b"  # json.dumps writes it as "a\ud800b": a high surrogate without its pair

# (endpoint, body, the param the 400 names): a lone surrogate in every kind of string
SURROGATES = [
    ("chat", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("chat", {"messages": [{"role": "system", "content": "\udc00"}, USER]}, "messages.0.content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("chat", {"messages": [USER], "stop": ["ok", LONE]}, "stop.1"),
    ("chat", {"messages": [USER], "user": LONE}, "user"),
    ("chat", {"messages": [USER], "tools": [{"type": "function", "function": {
        "name": "f", "description": LONE, "parameters": {"type": "object"}}}]}, "tools.0.function.description"),
    ("chat", {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": json.dumps({"q": "x"}) + LONE}}]}, {"role": "tool", "tool_call_id": "c1",
        "content": "r"}]}, "messages.1.tool_calls.0.function.arguments"),
    ("chat", {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {LONE: {"type": "string"}}}}}},
     "response_format.json_schema.schema.properties.a\\ud800b"),
    ("completions", {"prompt": LONE}, "prompt"),
    ("completions", {"prompt": ["\udbff"]}, "prompt.0"),
    ("completions", {"prompt": "ok", "stop": LONE}, "stop"),
    ("embeddings", {"input": LONE}, "input"),
    ("embeddings", {"input": ["fine", LONE]}, "input.1"),
]
TOKEN_IDS = [[True, False], [1, True], [1.0, 2], [1, "2"], [[1, True]], [-1], [None], [1, None]]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}


def _raw(endpoint: str, body: dict) -> bytes:
    return json.dumps({"model": "dev-a", **body}).encode()  # ensure_ascii: "\ud800" as an escape


@pytest.mark.parametrize("endpoint,body,param", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_a_lone_surrogate_is_400_in_the_shared_schemas(endpoint, body, param):
    """What the replica (and the embedding worker) validate with: 400 invalid_unicode naming where."""
    raw = _raw(endpoint, body)
    if endpoint == "embeddings":
        with pytest.raises(EmbeddingsRequestError) as e:
            parse_embeddings(json.loads(raw))
        assert (e.value.param, e.value.code) == (param, "invalid_unicode")
        return
    model = oai.ChatCompletionRequest if endpoint == "chat" else oai.CompletionRequest
    with pytest.raises(oai.OpenAIError) as e:
        oai.parse_request(model, raw)
    assert (e.value.status, e.value.type, e.value.param, e.value.code) == (
        400, "invalid_request_error", param, "invalid_unicode")


def test_surrogate_pairs_and_raw_utf8_text_pass():
    ok = json.dumps({"model": "m", "messages": [{"role": "user", "content": "smile \U0001F600 caf\u00e9 \ud55c"}]})
    assert oai.parse_request(oai.ChatCompletionRequest, ok.encode()).messages[0].content.startswith("smile")
    assert oai.parse_request(oai.ChatCompletionRequest, ok.encode("utf-8")).messages[0].content.endswith("\ud55c")
    pair = json.loads('{"a": ["x", {"b": "\\ud83d\\ude00"}]}')  # JSON decodes a pair as one character
    assert pair["a"][1]["b"] == "\U0001F600" and oai.lone_surrogate_path(pair) is None
    assert oai.lone_surrogate_path({"a": ["x", {"b": "\ud83d"}]}) == "a.1.b"


@pytest.mark.parametrize("prompt", TOKEN_IDS, ids=[json.dumps(p) for p in TOKEN_IDS])
def test_non_integer_token_ids_are_400_in_the_replica_schema(prompt):
    with pytest.raises(oai.OpenAIError) as e:
        oai.parse_request(oai.CompletionRequest, _raw("completions", {"prompt": prompt}))
    assert e.value.status == 400 and e.value.param == "prompt"
    assert oai.parse_request(oai.CompletionRequest, _raw("completions", {"prompt": [1, 2]})).prompt == [1, 2]


async def test_malformed_text_is_400_at_the_router_and_no_replica_is_tried():
    async with router_farm() as farm:
        key = farm.registry.add_tenant("acme")
        await farm.sync()
        cases = [(ep, body, param) for ep, body, param in SURROGATES]
        cases += [("completions", {"prompt": p}, "prompt") for p in TOKEN_IDS]
        async with httpx.AsyncClient(timeout=20) as http:
            for endpoint, body, param in cases:
                r = await http.post(farm.url + PATHS[endpoint], content=_raw(endpoint, body),
                                    headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})
                assert r.status_code == 400, (endpoint, body, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
                assert "x-replica-id" not in r.headers
            # a well-formed body still goes through
            r = await http.post(farm.url + PATHS["completions"], json={"model": "dev-a", "prompt": [1, 2]},
                                headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        tried = sum(len(rep.requests) for rep in farm.replicas.values())
        assert tried == 1  # only the well-formed one reached a replica
