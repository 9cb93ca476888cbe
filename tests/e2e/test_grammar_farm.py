"""Issue 21 through the farm (router -> two replicas, official openai client): a schema that crashes
llguidance fails only its own request with a 400 and both replicas keep serving (no replica lost,
so the router has nothing to fail over); parser-limit schemas are a 400, never a 200 with a broken
document; a cut-off tool call is never content."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.handler.test_grammar_pool import RECURSIVE_REQUIRED, many_properties, ref_chain


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def replicas_alive(farm) -> None:
    for rep in farm["replicas"]:
        os.kill(rep["pid"], 0)  # the process is there
        assert httpx.get(rep["url"] + "/health", timeout=10).status_code == 200


def test_a_crashing_schema_is_400_and_both_replicas_keep_serving(farm, client, alias):
    replicas_alive(farm)
    for _ in range(3):  # sent again and again: refused each time, no replica lost
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                           response_format=fmt(ref_chain(1000)))
        assert e.value.code == "invalid_schema" and "SIGSEGV" in e.value.message
    replicas_alive(farm)
    for _ in range(4):  # both replicas still answer schema requests (the router spreads them)
        r = client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                           temperature=0, response_format=fmt({
                                               "type": "object", "properties": {"n": {"type": "integer"}},
                                               "required": ["n"]}))
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content)["n"], int)


@pytest.mark.parametrize("schema", [many_properties(1000), RECURSIVE_REQUIRED], ids=["1000-props", "recursive"])
def test_parser_limit_schemas_are_400_never_a_broken_200(client, alias, schema):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            r = client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "x"}], n=4,
                                               max_tokens=32, temperature=1.0, stream=stream,
                                               response_format=fmt(schema))
            if stream:
                list(r)
        assert e.value.code == "invalid_schema"


def test_a_cut_off_tool_call_is_not_content(client, alias):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    r = client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "find it"}], tools=[tool],
                                       tool_choice="required", max_tokens=6, temperature=1.0, seed=2, n=2)
    for ch in r.choices:
        assert ch.finish_reason == "length" and not ch.message.content
    chunks = list(client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "find it"}],
                                                 tools=[tool], tool_choice="required", max_tokens=6,
                                                 temperature=1.0, seed=2, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "length"
