"""The OpenAI features through real processes (router -> replica) with the official openai client:
json_schema and the client's typed `parse`, tools (stream and not), logprobs, n > 1, penalties and
logit_bias passed through and applied, unsupported parameters refused by name."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


class User(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=150)
    tier: Literal["free", "pro", "team"]


def ask(content="where is my order"):
    return [{"role": "user", "content": content}]


def test_parse_with_a_pydantic_model(client, alias):
    out = client.chat.completions.parse(model=alias, messages=ask("make up a user"), response_format=User,
                                        max_tokens=120, temperature=0)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, User) and msg.parsed == User.model_validate_json(msg.content)


def test_json_schema_and_json_object_requests_in_parallel_with_free_ones(farm, tenant, alias):
    schema = {**User.model_json_schema(), "additionalProperties": False}

    async def go():
        ac = AsyncOpenAI(base_url=farm["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0, timeout=120)
        fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}}
        js = [ac.chat.completions.create(model=alias, messages=ask(f"user {i}"), response_format=fmt,
                                         max_tokens=120, temperature=0.8, seed=i) for i in range(16)]
        free = [ac.chat.completions.create(model=alias, messages=ask(), max_tokens=12, temperature=0)
                for _ in range(4)]
        res = await asyncio.gather(*js, *free)
        await ac.close()
        return res

    res = asyncio.run(go())
    for r in res[:16]:
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    marker = farm["markers"][alias]
    assert all(r.choices[0].message.content == marker for r in res[16:])


def test_tools_round_trip(client, alias):
    out = client.chat.completions.create(model=alias, messages=ask("weather in paris?"), tools=[WEATHER, CLOCK],
                                         tool_choice="required", max_tokens=200, temperature=0,
                                         parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    params = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)

    named = client.chat.completions.create(
        model=alias, messages=ask("what time is it"), tools=[WEATHER, CLOCK], max_tokens=200, temperature=0.5,
        seed=3, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]

    # the result goes back as a tool message; with tool_choice none the answer is plain text
    history = ask("weather in paris?") + [
        choice.message,  # the answer itself goes back as history, as agent loops do
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    final = client.chat.completions.create(model=alias, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=12, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)
    auto = client.chat.completions.create(model=alias, messages=ask(), tools=[WEATHER], max_tokens=40, temperature=0)
    msg = auto.choices[0].message
    assert msg.tool_calls or (auto.choices[0].finish_reason in ("stop", "length") and msg.content)


def test_tools_stream_in_the_openai_delta_format(client, alias):
    stream = client.chat.completions.create(model=alias, messages=ask("weather?"), tools=[WEATHER],
                                            tool_choice="required", max_tokens=200, temperature=0.7, seed=1,
                                            stream=True, stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish, content, usage = None, "", None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == "" and usage.completion_tokens > 0
    assert calls and all(c["name"] == "get_weather" and c["id"].startswith("call_") for c in calls.values())
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), WEATHER["function"]["parameters"])


def test_logprobs_chat_and_completions(client, alias):
    out = client.chat.completions.create(model=alias, messages=ask(), max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    text = out.choices[0].message.content
    assert "".join(t.token for t in content) == text
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
        assert bytes(t.bytes) == t.token.encode()
    streamed = [tok for chunk in client.chat.completions.create(
                    model=alias, messages=ask(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                    stream=True)
                for ch in chunk.choices if ch.logprobs for tok in ch.logprobs.content or []]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    comp = client.completions.create(model=alias, prompt="hello there", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_n_choices(client, alias):
    greedy = client.chat.completions.create(model=alias, messages=ask(), max_tokens=10, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    one = client.chat.completions.create(model=alias, messages=ask(), max_tokens=10, temperature=0)
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    comp = client.completions.create(model=alias, prompt="hello", max_tokens=6, temperature=0, n=2)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == comp.choices[1].text
    kw = dict(model=alias, messages=ask(), max_tokens=16, temperature=2.0, top_p=1.0, n=4, seed=11)
    sampled = client.chat.completions.create(**kw)
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == texts  # seeded
    seen: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(**{**kw, "stream": True}):
        for ch in chunk.choices:
            seen[ch.index] = seen.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2, 3} and [seen[i] for i in range(4)] == texts


def test_penalties_and_logit_bias_reach_the_sampler(farm, client, alias):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(farm["_farm"].model_dir / "tokenizer.json"))
    marker = farm["markers"][alias]
    first = tok.encode(marker, add_special_tokens=False).ids[0]
    plain = client.chat.completions.create(model=alias, messages=ask(), max_tokens=12, temperature=0)
    assert plain.choices[0].message.content == marker
    biased = client.chat.completions.create(model=alias, messages=ask(), max_tokens=12, temperature=0,
                                            logit_bias={str(first): -100})
    assert not biased.choices[0].message.content.startswith(tok.decode([first]))
    rep = client.chat.completions.create(model=alias, messages=ask(), max_tokens=12, temperature=0,
                                         presence_penalty=2.0, frequency_penalty=2.0,
                                         extra_body={"repetition_penalty": 3.0, "top_k": 5, "min_p": 0.05})
    assert rep.choices[0].message.content != marker  # the marker repeats '<', '>' and digits


@pytest.mark.parametrize("extra", [{"audio": {"voice": "alloy"}}, {"prediction": {"type": "content", "content": "x"}},
                                   {"store": True}, {"reasoning_effort": "low"}, {"function_call": "auto"},
                                   {"no_such_parameter": 1}])
def test_unsupported_parameters_are_400_naming_them(client, alias, extra):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=alias, messages=ask(), max_tokens=4, extra_body=extra)
    assert exc.value.body["code"] == "unsupported_parameter" and exc.value.body["param"] == next(iter(extra))


def test_prefix_cache_cached_tokens_through_the_router(client, alias):
    """A customer's long system prompt sent three times through the router (two replicas): at least
    two land on one replica, and the later of them reports the cached prompt tokens in the usage,
    streamed and not, with the same greedy answer."""
    from lorafarm.dev.adapters import random_prompts

    system = " ".join(random_prompts(seed=31, count=12))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "where is my parcel"}]
    outs = [client.chat.completions.create(model=alias, messages=msgs, max_tokens=6, temperature=0) for _ in range(2)]
    stream = client.chat.completions.create(model=alias, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert outs[0].usage.prompt_tokens > 150
    assert max(outs[1].usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens_details.cached_tokens) >= 128
    assert outs[1].choices[0].message.content == outs[0].choices[0].message.content == text
