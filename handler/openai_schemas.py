"""OpenAI-compatible request/response models for the replica, OpenAI error objects and the SSE
chunk helpers.

Requests are validated here (types, ranges, unsupported options such as `n > 1`) so the HTTP layer
only maps an `OpenAIError` to a response. Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (logits / T would overflow to inf/nan)


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


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Lenient):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    ignore_eos: bool = False  # vLLM-compatible extension: keep generating past EOS up to max_tokens

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

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError("n > 1 is not supported: this server returns one choice per request "
                             "(send several requests instead)")
        return v

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.max_completion_tokens is not None:  # both sent: the smaller, as the router charges
            self.max_tokens = min(self.max_tokens or self.max_completion_tokens, self.max_completion_tokens)
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.prompt, list):
            if len(self.prompt) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(self.prompt[0], str) and len(self.prompt) != 1:
                raise ValueError("a list of several prompts is not supported (send one request per prompt)")
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of > 1 is not supported")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

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
    """Validate a raw body; any problem becomes a 400 OpenAI error naming the offending field."""
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
        raise OpenAIError(400, f"Invalid request: {loc + ': ' if loc else ''}{msg}", param=param,
                          code=code) from None


# ------------------------------------------------------------------ responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def chat_completion(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, created: int | None = None) -> dict:
    return ChatCompletion(
        id=rid, created=created or now(), model=model,
        choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)],
        usage=usage(prompt_tokens, completion_tokens),
    ).model_dump()


def completion(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
               completion_tokens: int, created: int | None = None) -> dict:
    return Completion(
        id=rid, created=created or now(), model=model,
        choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
        usage=usage(prompt_tokens, completion_tokens),
    ).model_dump()


def chat_chunk(rid: str, model: str, created: int, *, content: str | None = None, role: bool = False,
               finish_reason: str | None = None) -> dict:
    """A `chat.completion.chunk`; the delta carries only what is set (role on the first chunk,
    content on token chunks, nothing on the final chunk with `finish_reason`)."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


def completion_chunk(rid: str, model: str, created: int, *, text: str = "",
                     finish_reason: str | None = None) -> dict:
    return Completion(
        id=rid, created=created, model=model,
        choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
    ).model_dump()


def usage_chunk(kind: str, rid: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The final chunk under `stream_options.include_usage`: `choices: []` and the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens).model_dump()}


def sse(obj: dict) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(err: OpenAIError) -> bytes:
    """An error after streaming began: one `data:` event holding the OpenAI error object."""
    return sse(err.body())
