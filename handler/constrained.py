"""Constrained decoding with llguidance: grammars for `response_format` and tool calls, one matcher
per constrained request, and the allowed-token mask of a step.

Why llguidance (over xgrammar and outlines-core): it installs with no dependencies at all (xgrammar
0.2.8 requires triton and apache-tvm-ffi besides torch; outlines-core only builds an index for a
regex, the JSON-schema-to-regex step and any CFG support are elsewhere), it reads a Hugging Face
fast tokenizer directly (`llguidance.hf.from_tokenizer`, byte-level BPE included), it compiles JSON
schema and Lark grammars (so `tool_choice: auto`, free text or a constrained call, is one grammar),
computes a mask in tens of microseconds with no per-vocabulary precompute, and is what vLLM and
SGLang use as one of their structured-output backends.

Grammar strings are built once per schema (`lru_cache` on the canonical JSON) and the compiled
matcher is built once per grammar and deep-copied for every request (`new_matcher`).

The mask: each constrained row's matcher fills one int32 bitmask row (bit t of word t // 32 set =
token t allowed), all rows in parallel on llguidance's thread pool; `allowed_tokens` unpacks them
at once into a bool [R, V] tensor. Sampled tokens advance the matchers in one parallel call too.

Tool calls use the Hermes/Qwen2 syntax, one call per block:
    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
"""

from __future__ import annotations

import json
import logging
import re
import threading
from functools import lru_cache
from typing import Any

import torch

log = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# compact JSON with OpenAI's separators: the model cannot spend its tokens on whitespace
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: dict[int, tuple[Any, Any]] = {}
_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int):
    """The llguidance view of a Hugging Face fast tokenizer (built once per tokenizer object)."""
    key = id(tokenizer)
    with _lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    import llguidance.hf

    llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    with _lock:
        _tokenizers[key] = (tokenizer, llt)
    return llt


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _with_options(schema: dict) -> dict:
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


@lru_cache(maxsize=1024)
def _schema_grammar(schema_json: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(_with_options(json.loads(schema_json)))


def json_schema_grammar(schema: dict) -> str:
    """A grammar for JSON documents valid against `schema` (cached per schema)."""
    return _schema_grammar(_canonical(schema))


def json_object_grammar() -> str:
    """JSON mode: any JSON object."""
    return json_schema_grammar({"type": "object"})


def _call_rule(tool: dict) -> str:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    head = TOOL_CALL_OPEN + '{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
    return f"{json.dumps(head)} %json {json.dumps(_with_options(params))} {json.dumps('}' + TOOL_CALL_CLOSE)}"


@lru_cache(maxsize=256)
def _tools_grammar(tools_json: str, choice: str, parallel: bool) -> str:
    from llguidance import LLMatcher, StructTag

    tools = json.loads(tools_json)
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t["function"]["name"] == choice]
    if choice == "auto":
        tags = [StructTag(trigger=TOOL_CALL_OPEN,
                          begin=TOOL_CALL_OPEN + '{"name": ' + json.dumps(t["function"]["name"]) + ', "arguments": ',
                          grammar=_with_options(t["function"].get("parameters") or {"type": "object"}),
                          end="}" + TOOL_CALL_CLOSE) for t in tools]
        return StructTag.to_grammar(tags, assume_special=False)
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    lark = f'start: call ("\\n" call)*\n' if parallel else "start: call\n"
    lark += f"call: {calls}\n" + "".join(f"call_{i}: {_call_rule(t)}\n" for i, t in enumerate(tools))
    return LLMatcher.grammar_from_lark(lark)


def tools_grammar(tools: list[dict], choice: str, parallel: bool = True) -> str:
    """The grammar of an answer under `tool_choice`: "auto" (free text in which every
    `<tool_call>` block is a valid call), "required" (one or more calls, one with `parallel=False`)
    or a tool's name (exactly one call of that tool)."""
    return _tools_grammar(_canonical(tools), choice, parallel if choice == "required" else False)


_compiled: dict[tuple[str, int], Any] = {}


def new_matcher(grammar: str, tokenizer, vocab_size: int):
    """A fresh matcher for one request: a deep copy of the grammar's compiled matcher.
    ValueError when the grammar does not compile (e.g. an unsupported JSON-schema keyword)."""
    from llguidance import LLMatcher

    llt = ll_tokenizer(tokenizer, vocab_size)
    key = (grammar, id(llt))
    with _lock:
        base = _compiled.get(key)
    if base is None:
        base = LLMatcher(llt, grammar, log_level=0)
        if base.is_error():
            raise ValueError(f"the grammar does not compile: {base.get_error()}")
        with _lock:
            if len(_compiled) > 1024:
                _compiled.clear()
            _compiled[key] = base
    return base.deep_copy()


def check_grammar(grammar: str, tokenizer, vocab_size: int) -> str | None:
    """None when the grammar compiles for this tokenizer, else the error message."""
    try:
        new_matcher(grammar, tokenizer, vocab_size)
    except ValueError as e:
        return str(e)
    return None


_BITS = None
_EXECUTOR = None


def _executor():
    """llguidance's thread pool: the rows' masks are computed in parallel, outside the GIL."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from llguidance import LLExecutor

        _EXECUTOR = LLExecutor()
    return _EXECUTOR


def consume(matchers_tokens: list[tuple]) -> None:
    """Advance each (matcher, token) pair at once (in parallel)."""
    if matchers_tokens:
        _executor().consume_token_par(matchers_tokens)


def allowed_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """bool [len(matchers), vocab_size]: the tokens each matcher allows next (a matcher in an error
    state, which should not happen, allows everything, with a warning)."""
    global _BITS
    # llguidance.torch has these helpers, but importing it runs a torch.compile decorator (~10 s
    # of torch._dynamo import on first use); the executor's pointer API is all they wrap
    words = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], words.data_ptr(),
                                        words.shape[1] * 4, len(matchers))
    if _BITS is None:
        _BITS = torch.arange(32, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> _BITS) & 1  # [R, W, 32], little-endian within a word
    allowed = bits.reshape(len(matchers), -1)[:, :vocab_size].bool()
    stuck = ~allowed.any(dim=-1)
    if bool(stuck.any()):  # a matcher in an error state: let the row run out rather than sample from nothing
        for i in stuck.nonzero().flatten().tolist():
            log.warning("grammar matcher allows no token (%s); the row is unconstrained from here",
                        matchers[i].get_error())
        allowed[stuck] = True
    return allowed


_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


def parse_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Split a generated answer into its text content (None when empty) and its tool calls as
    (name, arguments JSON). A block that is not a call object stays in the content."""
    calls: list[tuple[str, str]] = []
    content: list[str] = []
    pos = 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            continue
        content.append(text[pos:m.start()])
        calls.append((name, json.dumps(args, ensure_ascii=False)))
        pos = m.end()
    content.append(text[pos:])
    body = "".join(content).strip() if calls else "".join(content)
    return (body or None), calls


class ToolCallStream:
    """Streams an answer under tools: text goes out as content, except text that is or may become a
    `<tool_call>` block, which is held back until its `</tool_call>`; then the call goes out whole as
    one OpenAI `tool_calls` delta entry (index, id, type, function name and arguments).

        ts = ToolCallStream(new_id)
        content, calls = ts.feed(text)     # calls: [(index, id, name, arguments JSON)]
        content, calls = ts.close()        # at the end: whatever is still held back
    """

    def __init__(self, new_id):
        self.new_id = new_id
        self.buf = ""
        self.calls = 0

    def _drain(self, final: bool) -> tuple[str, list]:
        content, calls = "", []
        while self.buf:
            start = self.buf.find(TOOL_CALL_OPEN)
            if start < 0:
                # hold back a tail that may be the start of a call block
                keep = 0 if final else next((k for k in range(min(len(TOOL_CALL_OPEN) - 1, len(self.buf)), 0, -1)
                                             if TOOL_CALL_OPEN.startswith(self.buf[-k:])), 0)
                content += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                content += self.buf[:start]
                self.buf = self.buf[start:]
                if final:
                    content += self.buf
                    self.buf = ""
                break
            block = self.buf[start: end + len(TOOL_CALL_CLOSE)]
            body, parsed = parse_tool_calls(block)
            content += self.buf[:start]
            if parsed:
                name, args = parsed[0]
                calls.append((self.calls, self.new_id(), name, args))
                self.calls += 1
            else:
                content += block
            self.buf = self.buf[end + len(TOOL_CALL_CLOSE):]
        if self.calls and not content.strip():
            content = ""  # whitespace between calls is not content
        return content, calls

    def feed(self, text: str) -> tuple[str, list]:
        self.buf += text
        return self._drain(False)

    def close(self) -> tuple[str, list]:
        return self._drain(True)
