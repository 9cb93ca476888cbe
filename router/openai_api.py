"""The OpenAI-shaped edges of the router: request validation, token estimates, error objects."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from lorafarm.limits import MAX_N  # one limit for `n` at the router and the replica, refused here before any charge
# one max_tokens rule at the router and the replica: the router charges what the replica generates
from lorafarm.openai_schemas import COMPLETIONS_MAX_TOKENS, DEFAULT_MAX_TOKENS, effective_max_tokens
# one rule for malformed text at the router and the replica: a lone UTF-16 surrogate anywhere is a 400
from lorafarm.openai_schemas import LONE_SURROGATE_CODE, lone_surrogate_message, lone_surrogate_path

CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
UPSTREAM_PATH = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", EMBEDDINGS: "/v1/embeddings"}
# what a torch.Generator accepts as a seed (the replica refuses the rest the same way)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOKENS_LIMIT = 2**31 - 1  # no model's context comes near; bounds what a request can charge or reserve
MAX_LOGIT_BIAS = 300  # entries (the replica's schema enforces the same)


class ApiError(Exception):
    """An OpenAI error answer: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


@dataclass(frozen=True)
class ParsedRequest:
    endpoint: str
    body: dict
    model: str
    stream: bool
    prompt_tokens: int  # estimate
    max_tokens: int
    n: int

    @property
    def cost(self) -> int:
        """Tokens charged to the tenant's bucket up front: prompt + max_tokens (x n)."""
        return self.prompt_tokens + self.max_tokens * self.n


def _text_tokens(text: str) -> int:
    # no tokenizer at the gateway: ~4 characters per token, the usual English estimate
    return math.ceil(len(text) / 4) if text else 0


def _content_tokens(content) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                total += _text_tokens(part["text"])
            elif isinstance(part, str):
                total += _text_tokens(part)
        return total
    return 0


def estimate_prompt_tokens(endpoint: str, body: dict) -> int:
    if endpoint == CHAT:
        return sum(4 + _content_tokens(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return len(prompt)
        total = 0
        for p in prompt:
            if isinstance(p, str):
                total += _text_tokens(p)
            elif isinstance(p, list):
                total += len(p)
        return total
    return 0


INLINE_PARSE_BYTES = 64 * 1024  # a bigger body is parsed in a worker thread


async def parse_request_off_loop(endpoint: str, raw: bytes,
                                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> ParsedRequest:
    """`parse_request`, in a worker thread for a big body (2,048 embedding inputs, a long prompt: tens
    of milliseconds of JSON and Python checks that would otherwise stall every tenant on this router)."""
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_request(endpoint, raw, default_max_tokens)
    import asyncio

    return await asyncio.to_thread(parse_request, endpoint, raw, default_max_tokens)


def parse_request(endpoint: str, raw: bytes, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> ParsedRequest:
    if endpoint == EMBEDDINGS:
        return parse_embeddings_request(raw)
    try:
        body = json.loads(raw) if raw else None
    except ValueError:  # also invalid UTF-8 (UnicodeDecodeError)
        raise ApiError(400, "The request body is not valid JSON.") from None
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    check_text(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "you must provide a model parameter", param="model", code="missing_required_parameter")
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError(400, "you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
        check_prompt(body["prompt"])
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_TOKENS_LIMIT):
            raise ApiError(400, f"'{name}' must be an integer in [1, {MAX_TOKENS_LIMIT}]", param=name)
    # what the replica generates, so what is charged (`effective_max_tokens`: both sent, the smaller); a
    # completion without the field gets its schema's default (CompletionRequest.max_tokens), as there
    sent = body.get("max_tokens", COMPLETIONS_MAX_TOKENS if endpoint == COMPLETIONS else None)
    max_tokens = effective_max_tokens(sent, body.get("max_completion_tokens"), default_max_tokens)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed <= SEED_MAX):
        raise ApiError(400, f"'seed' must be an integer in [{SEED_MIN}, {SEED_MAX}]", param="seed")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be an integer in [1, {MAX_N}]", param="n")
    check_logit_bias(body.get("logit_bias"))
    return ParsedRequest(
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        prompt_tokens=estimate_prompt_tokens(endpoint, body),
        max_tokens=max_tokens,
        n=n,
    )


def check_text(body: dict) -> None:
    """400 for a lone UTF-16 surrogate in any string of the body (a value or a key): not valid
    Unicode, and a replica's tokenizer fails on it (lorafarm/openai_schemas.py)."""
    where = lone_surrogate_path(body)
    if where is not None:
        raise ApiError(400, lone_surrogate_message(where), param=where, code=LONE_SURROGATE_CODE)


def _token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


_PROMPT_SHAPES = ("'prompt' must be a string, an array of strings, an array of token ids (non-negative "
                  "integers) or an array of arrays of token ids")


def check_prompt(prompt) -> None:
    """`/v1/completions` `prompt` as OpenAI accepts it: a string, an array of strings, an array of
    token ids or an array of arrays of token ids. Token ids are non-negative integers: never true/false
    (which JSON decoders read as 1/0) nor 1.0. Anything else is a 400 before any replica is tried."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise ApiError(400, _PROMPT_SHAPES, param="prompt")
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return
    if all(_token_id(p) for p in prompt):
        return
    if all(isinstance(p, list) and p and all(_token_id(t) for t in p) for p in prompt):
        return
    bad = next((t for p in prompt for t in (p if isinstance(p, list) else [p]) if not isinstance(t, str)
                and not _token_id(t)), None)
    detail = f" (got {json.dumps(bad)[:40]})" if bad is not None else ""
    raise ApiError(400, _PROMPT_SHAPES + detail, param="prompt")


def check_logit_bias(bias) -> None:
    """`logit_bias`: an object of token ids (ASCII decimal strings) -> numbers in [-100, 100]; a 400
    here, so that no replica (nor a foreign worker) ever sees one that cannot be read."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' has at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10):
            raise ApiError(400, f"'logit_bias' keys are token ids (decimal integers), got {k[:40]!r}",
                           param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got {str(v)[:40]}",
                           param="logit_bias")


def parse_embeddings_request(raw: bytes) -> ParsedRequest:
    """`POST /v1/embeddings`, checked by `lorafarm.embeddings` (the worker checks the same way, plus
    the model's context); the cost charged up front is the estimated input tokens."""
    from lorafarm.embeddings import EmbeddingsRequestError, parse_embeddings

    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        raise ApiError(400, "The request body is not valid JSON.") from None
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    try:
        req = parse_embeddings(body)
    except EmbeddingsRequestError as e:
        raise ApiError(400, e.message, param=e.param, code=e.code) from None
    return ParsedRequest(endpoint=EMBEDDINGS, body=body, model=req.model, stream=False,
                         prompt_tokens=req.estimated_tokens(), max_tokens=0, n=1)
