"""OpenAI-compatible request/response models for the replica, OpenAI error objects and the SSE
chunk helpers.

Requests are validated here (types, ranges, combinations) so the HTTP layer only maps an
`OpenAIError` to a response. A parameter this server does not implement is a 400 with code
`unsupported_parameter` naming it (`param`), never silently ignored; so is a field OpenAI does not
define (OpenAI answers those with a 400 too). docs/api.md has the table of supported parameters.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from lorafarm.limits import MAX_N  # one limit for `n` at the router and the replica

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (logits / T would overflow to inf/nan)
MAX_TOP_LOGPROBS = 20

# The max_tokens rule, one for the router (what it charges up front: rate limits, token budgets) and the
# replica (what it generates). A request that sets no limit generates up to DEFAULT_MAX_TOKENS (the
# replica caps that default to the model's context), so the router charges what will be generated.
DEFAULT_MAX_TOKENS = 512
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without a max_tokens field (OpenAI's default there)


def effective_max_tokens(max_tokens: int | None, max_completion_tokens: int | None = None,
                         default: int | None = DEFAULT_MAX_TOKENS) -> int | None:
    """The most tokens a request generates (per choice): max_tokens and max_completion_tokens both sent,
    the smaller; one sent, that one; neither, `default`."""
    sent = [v for v in (max_tokens, max_completion_tokens) if v is not None]
    return min(sent) if sent else default


# -- malformed text: lone UTF-16 surrogates -------------------------------------------------------
# JSON can carry a UTF-16 surrogate escape without its pair ("a\\ud800b"); Python's json module
# decodes it into a str that is not valid Unicode (it cannot be encoded to UTF-8), and a tokenizer
# fails on it with a TypeError (a 500, retried on every replica). The router and the replica (and the
# embedding worker, lorafarm/embeddings.py) refuse such a body with a 400 wherever the string is: any
# value or object key. A correct pair ("\\ud83d\\ude00") is decoded into one character and passes.

_SURROGATE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE_CODE = "invalid_unicode"


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _safe_key(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")[:64] if _has_surrogate(key) else key[:64]


def lone_surrogate_path(value: Any) -> str | None:
    """Where the first string holding a lone UTF-16 surrogate is in a decoded JSON value, as a dotted
    path (`messages.0.content`, the form pydantic's errors use; "body" for the top level), or None.
    Iterative: a deeply nested body cannot overflow the stack here."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                return ".".join(path) or "body"
        elif isinstance(v, dict):
            items = list(v.items())
            for k, x in reversed(items):
                if isinstance(k, str) and _has_surrogate(k):
                    return ".".join((*path, _safe_key(k))) or "body"
                if isinstance(x, (str, dict, list)):
                    stack.append((x, (*path, str(k)[:64])))
        elif isinstance(v, list):
            for i in range(len(v) - 1, -1, -1):
                x = v[i]
                if isinstance(x, (str, dict, list)):
                    stack.append((x, (*path, str(i))))
    return None


def lone_surrogate_message(path: str) -> str:
    return (f"Invalid request: {path}: the text holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
            "without its pair), which is not valid Unicode; send well-formed text (surrogates only in pairs).")


# -- test-only fault: a body that kills the replica it reaches -----------------------------------
# Set only in test farms (tests/reliability/test_poison.py): a replica that parses a request body
# holding this marker SIGKILLs itself, as a body that crashes the engine would. The router's poison
# guard (router/poison.py) must lose at most two replicas to it. Unset (production): no effect.
TEST_KILLER_ENV = "LORAFARM_TEST_KILLER_BODY"


def _test_killer(raw: bytes | dict) -> None:
    marker = os.environ.get(TEST_KILLER_ENV)
    if not marker or len(marker) < 16:  # a short marker could match a real body by accident
        return
    data = raw if isinstance(raw, (bytes, bytearray)) else json.dumps(raw, ensure_ascii=False).encode(
        "utf-8", "surrogatepass")
    if marker.encode() in data:
        os.kill(os.getpid(), signal.SIGKILL)


# -- test-only fault: a version whose requests fail -------------------------------------------------
# Set only in test farms (tests/e2e/test_rollout.py): a replica answers every request for an adapter
# id listed here (comma-separated) with a 500, as a broken fine-tune would, so that a rollout of it
# must roll back. Only exact adapter ids (ad- + 20 hex) match; unset (production): no effect.
TEST_FAILING_ADAPTER_ENV = "LORAFARM_TEST_FAILING_ADAPTER"


def _test_failing_adapter(data: dict) -> None:
    ids = os.environ.get(TEST_FAILING_ADAPTER_ENV)
    model = data.get("model") if ids else None
    if isinstance(model, str) and re.fullmatch(r"ad-[0-9a-f]{20}", model) and model in ids.split(","):
        raise OpenAIError(500, f"test fault: requests for {model} fail ({TEST_FAILING_ADAPTER_ENV})",
                          type="server_error", code="test_fault")


class OpenAIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist or is not served by this replica.",
                       type="invalid_request_error", param="model", code="model_not_found")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    """A request object: a field this server does not know is a 400 naming it (as OpenAI does)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Lenient):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # obfuscation padding is never added


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Lenient):
    name: str
    arguments: str = "{}"


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # what an earlier answer carried, sent back as history: accepted, not shown to the model
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Lenient):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class _SamplingFields(_Strict):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    user: str | None = None  # accepted: logged by the router, no effect on generation
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM-compatible extensions
    ignore_eos: bool = False  # keep generating past EOS up to max_tokens
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _none_is_default(cls, v, info):
        if v is None:
            return 1.0
        return v

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, v):
        return 0.0 if v < GREEDY_BELOW else v

    @field_validator("n", "top_k", mode="before")
    @classmethod
    def _none_is_default_int(cls, v, info):
        if v is None:
            return 1 if info.field_name == "n" else 0
        return v

    @field_validator("presence_penalty", "frequency_penalty", "min_p", mode="before")
    @classmethod
    def _none_is_zero(cls, v):
        return 0.0 if v is None else v

    @field_validator("repetition_penalty", mode="before")
    @classmethod
    def _none_is_one(cls, v):
        return 1.0 if v is None else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        for s in stops:
            if not s:
                raise ValueError("stop sequences must not be empty")
            if len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"stop sequences are at most {MAX_STOP_LENGTH} characters")
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_numbers(cls, v):
        if isinstance(v, dict):  # numbers, not "5" or true (the router refuses those the same way)
            for k, b in v.items():
                if isinstance(b, bool) or not isinstance(b, (int, float)):
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {str(b)[:40]}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if not v:
            return None
        if len(v) > 300:
            raise ValueError("logit_bias has at most 300 entries")
        for k, b in v.items():
            # ASCII digits only: str.isdigit() is also true for "²" or "٣", which int() refuses or reads
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise ValueError(f"logit_bias keys are token ids (decimal integers), got {k[:40]!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}


def _unsupported(data: dict, names: dict[str, Any]) -> None:
    """Raise for a parameter that OpenAI defines but this server does not implement, unless it has
    its no-op value (for instance `store: false`)."""
    for name, allowed in names.items():
        if name in data and data[name] is not None and data[name] not in allowed:
            raise OpenAIError(400, f"Invalid request: {name}: {name} is not supported by this server",
                              param=name, code="unsupported_parameter")


# OpenAI chat parameters this server does not implement: (values that are a no-op and pass)
CHAT_UNSUPPORTED: dict[str, tuple] = {
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "verbosity": (),
    "web_search_options": (), "functions": (), "function_call": ("none",), "store": (False,),
    "metadata": ({},), "service_tier": ("auto", "default"),
}
COMPLETION_UNSUPPORTED: dict[str, tuple] = {"echo": (False,), "best_of": (1,), "suffix": ("",)}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted, no effect on generation (identifiers and cache hints)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # the no-op values of unsupported parameters (validated in `parse_request`)
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    function_call: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.max_completion_tokens is not None:  # both sent: the smaller, as the router charges
            self.max_tokens = effective_max_tokens(self.max_tokens, self.max_completion_tokens)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tools is not None and len(self.tools) == 0:
            self.tools = None
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise ValueError("tool_choice is only allowed when tools are specified")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names a function that is not in tools: {self.tool_choice.function.name!r}")
        if self.uses_tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format together with tools is not supported (send tool_choice: none "
                             "to constrain the answer with response_format)")
        return self

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_mode(self) -> str | None:
        """None (no tools), "auto", "required" or the named function."""
        if not self.uses_tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @property
    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt]  # token ids are integers, never true/false or 1.0
    max_tokens: int | None = Field(default=COMPLETIONS_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        if isinstance(v, list) and v and not all(isinstance(x, str) for x in v):
            if any(isinstance(x, list) for x in v):
                raise ValueError("an array of token-id arrays (several prompts) is not supported (send one "
                                 "request per prompt)")
            if any(isinstance(x, str) for x in v):
                raise ValueError("prompt must not mix strings and token ids")
            bad = [x for x in v if isinstance(x, bool) or not isinstance(x, int)]  # null is bad too
            if bad:
                raise ValueError(f"prompt token ids must be integers, got {json.dumps(bad[0])[:40]}")
            if any(x < 0 for x in v):
                raise ValueError("prompt token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.prompt, list):
            if len(self.prompt) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(self.prompt[0], str) and len(self.prompt) != 1:
                raise ValueError("a list of several prompts is not supported (send one request per prompt)")
        return self

    @property
    def n_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str | None:
        if isinstance(self.prompt, str):
            return self.prompt
        if isinstance(self.prompt[0], str):
            return self.prompt[0]
        return None

    def prompt_token_ids(self) -> list[int] | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], int):
            return list(self.prompt)
        return None


def parse_request(model: type[_SamplingFields], raw: bytes | dict) -> Any:
    """Validate a raw body; any problem becomes a 400 OpenAI error naming the offending field (a lone
    UTF-16 surrogate anywhere: 400 `invalid_unicode`)."""
    _test_killer(raw)
    if isinstance(raw, (bytes, bytearray)):
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"The request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad_request("The request body is nested too deeply.") from None
    else:
        data = raw
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    where = lone_surrogate_path(data)
    if where is not None:
        raise OpenAIError(400, lone_surrogate_message(where), param=where, code=LONE_SURROGATE_CODE)
    _test_failing_adapter(data)
    _unsupported(data, CHAT_UNSUPPORTED if model is ChatCompletionRequest else COMPLETION_UNSUPPORTED)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if p is not None)
        msg = err.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        param = loc or None
        code = "unsupported_parameter" if ("not supported" in msg) else "invalid_value"
        if err.get("type") == "missing":
            code = "missing_required_parameter"
        elif err.get("type") == "extra_forbidden":
            code = "unsupported_parameter"
            msg = f"{loc} is not a parameter this server supports"
        raise OpenAIError(400, f"Invalid request: {loc + ': ' if loc else ''}{msg}", param=param,
                          code=code) from None


# ------------------------------------------------------------------ responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (handler.model.prefix_cache)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# A token's logprobs as the engine reports them: (token id, logprob, [(token id, logprob), ...top])
LogprobEntry = tuple[int, float, list[tuple[int, float]]]


def _token_obj(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[LogprobEntry], token_text: Callable[[int], str]) -> dict:
    """The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}`."""
    content = [{**_token_obj(token_text(t), lp), "top_logprobs": [_token_obj(token_text(i), v) for i, v in top]}
               for t, lp, top in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[LogprobEntry], token_text: Callable[[int], str], offset: int = 0) -> dict:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_text(t) for t, _, _ in entries]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(i): v for i, v in top} for _, _, top in entries],
            "text_offset": offsets}


def tool_calls_obj(calls: list[tuple[str, str, str]]) -> list[dict]:
    """[(call id, name, arguments JSON)] -> the message's `tool_calls`."""
    return [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in calls]


def chat_choice(index: int, content: str | None, finish_reason: str, *, tool_calls: list[dict] | None = None,
                logprobs: dict | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_completion(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                    created: int | None = None, cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created or now(), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens).model_dump()}


def completion(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
               created: int | None = None, cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created or now(), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens).model_dump()}


def chat_chunk(rid: str, model: str, created: int, *, content: str | None = None, role: bool = False,
               finish_reason: str | None = None, index: int = 0, tool_calls: list[dict] | None = None,
               logprobs: dict | None = None) -> dict:
    """A `chat.completion.chunk`; the delta carries only what is set (role on the first chunk,
    content on token chunks, tool_calls (each with its `index`) once a call is complete, nothing on
    the final chunk with `finish_reason`)."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def completion_chunk(rid: str, model: str, created: int, *, text: str = "", finish_reason: str | None = None,
                     index: int = 0, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def usage_chunk(kind: str, rid: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The final chunk under `stream_options.include_usage`: `choices: []` and the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens).model_dump()}


def sse(obj: dict) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(err: OpenAIError) -> bytes:
    """An error after streaming began: one `data:` event holding the OpenAI error object."""
    return sse(err.body())
