"""The OpenAI embeddings request (`POST /v1/embeddings`), validated the same way by the router and by
the embedding worker: `parse_embeddings(body) -> EmbeddingsRequest` or `EmbeddingsRequestError`.

Accepted as OpenAI does: `input` a string, a list of strings, a list of token ids, or a list of
lists of token ids; at most `MAX_INPUTS` inputs, none empty; `encoding_format` "float" (default) or
"base64"; `dimensions` a positive integer (the worker checks it against the model); `user` a string.
Any other field is a 400 naming it (`unsupported_parameter`), as for chat and completions.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
FIELDS = ("model", "input", "encoding_format", "dimensions", "user")


class EmbeddingsRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    texts: list[str] | None  # exactly one of texts / token_ids is set
    token_ids: list[list[int]] | None
    encoding_format: str = "float"
    dimensions: int | None = None

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or [])

    def estimated_tokens(self) -> int:
        """~4 characters per token for text (no tokenizer at the gateway), exact for token ids."""
        if self.texts is not None:
            return sum(-(-len(t) // 4) for t in self.texts)
        return sum(len(r) for r in self.token_ids or [])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_embeddings(body) -> EmbeddingsRequest:
    if not isinstance(body, dict):
        raise EmbeddingsRequestError("The request body must be a JSON object.")
    from lorafarm.openai_schemas import LONE_SURROGATE_CODE, lone_surrogate_message, lone_surrogate_path

    where = lone_surrogate_path(body)  # a tokenizer fails on such text (500): refused like chat's
    if where is not None:
        raise EmbeddingsRequestError(lone_surrogate_message(where), where, LONE_SURROGATE_CODE)
    unknown = next((k for k in body if k not in FIELDS), None)
    if unknown is not None:
        name = str(unknown)[:64]
        raise EmbeddingsRequestError(f"Invalid request: {name} is not a parameter this server supports", name,
                                     "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise EmbeddingsRequestError("you must provide a model parameter", "model", "missing_required_parameter")
    if "input" not in body or body["input"] is None:
        raise EmbeddingsRequestError("you must provide an input parameter", "input", "missing_required_parameter")
    raw = body["input"]
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list):
        if not raw:
            raise EmbeddingsRequestError("'input' must not be empty", "input")
        if all(isinstance(x, str) for x in raw):
            texts = list(raw)
        elif all(_is_int(x) for x in raw):
            ids = [list(raw)]
        elif all(isinstance(x, list) and all(_is_int(t) for t in x) for x in raw):
            ids = [list(x) for x in raw]
        else:
            raise EmbeddingsRequestError(
                "'input' must be a string, an array of strings, an array of token ids or an array of "
                "arrays of token ids", "input")
    else:
        raise EmbeddingsRequestError(
            "'input' must be a string, an array of strings, an array of token ids or an array of arrays "
            "of token ids", "input")
    rows = texts if texts is not None else ids
    if len(rows) > MAX_INPUTS:
        raise EmbeddingsRequestError(f"'input' holds {len(rows)} inputs; at most {MAX_INPUTS} per request", "input")
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise EmbeddingsRequestError(f"input[{i}] is empty; every input must be non-empty", "input")
    if ids is not None and any(t < 0 for r in ids for t in r):
        raise EmbeddingsRequestError("token ids must be non-negative", "input")
    fmt = body.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise EmbeddingsRequestError("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise EmbeddingsRequestError("'dimensions' must be a positive integer", "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise EmbeddingsRequestError("'user' must be a string", "user")
    return EmbeddingsRequest(model=model, texts=texts, token_ids=ids, encoding_format=fmt, dimensions=dims)
