"""Constrained decoding with llguidance: grammars for `response_format` and tool calls, one matcher
per constrained request, and the allowed-token mask of a step.

Why llguidance (over xgrammar and outlines-core): it installs with no dependencies at all (xgrammar
0.2.8 requires triton and apache-tvm-ffi besides torch; outlines-core only builds an index for a
regex, the JSON-schema-to-regex step and any CFG support are elsewhere), it reads a Hugging Face
fast tokenizer directly (`llguidance.hf.from_tokenizer`, byte-level BPE included), it compiles JSON
schema and Lark grammars (so `tool_choice: auto`, free text or a constrained call, is one grammar),
computes a mask in tens of microseconds with no per-vocabulary precompute, and is what vLLM and
SGLang use as one of their structured-output backends.

Untrusted grammar work runs behind a process boundary (`handler.grammar.pool`): a worker process
builds the grammar string from the request's schema or tools (the functions below), compiles it
into a matcher and test-runs it within a wall-time and memory limit; the replica then builds its own
matcher from the validated grammar on a background thread (`GrammarBuilder`) and keeps it in a
cache bounded by bytes and per tenant (`GrammarCache`). Each request gets a deep copy of it
(`CompiledGrammar.matcher`). `new_matcher(str)` still compiles in-process (engine tests, tools).

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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from handler.threads import FairThreadPool

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# the replica's matcher-build thread (GrammarBuilder): 8x a worker's compile thread
# (handler.grammar.pool.WORKER_STACK_BYTES), a margin over what compiled there
REPLICA_STACK_BYTES = 64 * 1024**2

# compact JSON with OpenAI's separators: the model cannot spend its tokens on whitespace
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# llguidance's fuel for building the lexer's regex expressions (its default: 1,000,000), the same in the
# grammar workers and the replica. At 400,000 a regex that expands without end (`^(a{1000}){300}$`:
# 3.5 s of 24 test masks at the default, and for a little more the 4 s worker timeout plus a worker
# respawn) is refused in ~0.2-0.3 s with "too many expressions constructed", while schemas people send
# stay below it: an object of 10,000 required properties needs 200,000-300,000; a 3,000-string enum,
# formats, patterns and nesting far less (tests/handler/test_grammar_pool.py).
INITIAL_LEXER_FUEL = 400_000

_tokenizers: dict[int, tuple[Any, Any]] = {}
_lock = threading.Lock()


def new_base_matcher(llt, grammar: str):
    """llguidance's matcher for `grammar` under the limits every matcher here shares (an error
    state, never an exception, when it does not compile or a limit is hit)."""
    from llguidance import LLMatcher, LLParserLimits

    return LLMatcher(llt, grammar, log_level=0, limits=LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL))


def ll_tokenizer(tokenizer, vocab_size: int):
    """The llguidance view of a Hugging Face fast tokenizer (built once per tokenizer object)."""
    key = id(tokenizer)
    with _lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    import llguidance

    spec = tokenizer_spec(tokenizer, vocab_size)  # what llguidance.hf.from_tokenizer does, without transformers
    llt = llguidance.LLTokenizer(spec["tokenizer"], n_vocab=spec["n_vocab"], eos_token=spec["eos"])
    with _lock:
        _tokenizers[key] = (tokenizer, llt)
    return llt


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _with_options(schema: dict) -> dict:
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


def json_schema_grammar(schema: dict) -> str:
    """A grammar for JSON documents valid against `schema` (not cached: the worker process runs it,
    the replica caches the compiled result, see GrammarCache). ValueError for an invalid schema."""
    from llguidance import LLMatcher

    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be an object")
    return LLMatcher.grammar_from_json_schema(_with_options(schema))


def json_object_grammar() -> str:
    """JSON mode: any JSON object."""
    return json_schema_grammar({"type": "object"})


def _call_rule(tool: dict) -> str:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    head = TOOL_CALL_OPEN + '{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
    return f"{json.dumps(head)} %json {json.dumps(_with_options(params))} {json.dumps('}' + TOOL_CALL_CLOSE)}"


def _tools_grammar(tools: list[dict], choice: str, parallel: bool) -> str:
    from llguidance import LLMatcher, StructTag

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
    return _tools_grammar(tools, choice, parallel if choice == "required" else False)


def tokenizer_spec(tokenizer, vocab_size: int) -> dict:
    """What a worker process needs to rebuild `ll_tokenizer(tokenizer, vocab_size)` without
    transformers (see llguidance.hf.from_tokenizer): the serialized fast tokenizer, vocab and EOS."""
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return {"tokenizer": backend.to_str(), "n_vocab": int(vocab_size), "eos": tokenizer.eos_token_id}


@dataclass(eq=False)
class CompiledGrammar:
    """A grammar a worker process compiled and test-ran (handler.grammar.pool), with the replica's
    own compiled matcher of it: every request (every choice) gets a deep copy (`matcher()`, ~50 us).
    `cost`: the bytes it holds (grammar text + the matcher's memory as the worker measured it)."""

    grammar: str
    base: Any
    cost: int

    def matcher(self):
        return self.base.deep_copy()


class GrammarCache:
    """Compiled grammars by key (a hash of the request's canonical schema/tools), LRU, bounded by
    bytes in all (`max_bytes`) and per tenant (`tenant_bytes`): a tenant over its share evicts its
    own least recently used entries first, then the cache evicts globally. An entry larger than a
    tenant's share is not kept (the request is still served). Evicting only drops the cache's
    reference: requests in flight keep their matchers. Thread-safe."""

    def __init__(self, max_bytes: int = 256 * 1024**2, tenant_bytes: int | None = None):
        self.max_bytes = int(max_bytes)
        self.tenant_bytes = int(tenant_bytes if tenant_bytes is not None else max(1, self.max_bytes // 4))
        self._entries: OrderedDict[str, tuple[str, CompiledGrammar]] = OrderedDict()
        self._tenant_use: dict[str, int] = {}
        self.bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[1]

    def tenant_bytes_used(self, tenant: str) -> int:
        with self._lock:
            return self._tenant_use.get(tenant, 0)

    def _drop(self, key: str) -> None:
        tenant, entry = self._entries.pop(key)
        self.bytes -= entry.cost
        left = self._tenant_use[tenant] - entry.cost
        if left > 0:
            self._tenant_use[tenant] = left
        else:
            self._tenant_use.pop(tenant, None)
        self.evictions += 1

    def put(self, key: str, tenant: str, entry: CompiledGrammar) -> bool:
        """Keep `entry` (True), or not when it alone exceeds a tenant's share (False)."""
        if entry.cost > min(self.tenant_bytes, self.max_bytes):
            return False
        with self._lock:
            if key in self._entries:
                self._drop(key)
                self.evictions -= 1
            while self._tenant_use.get(tenant, 0) + entry.cost > self.tenant_bytes:
                self._drop(next(k for k, (t, _) in self._entries.items() if t == tenant))
            while self.bytes + entry.cost > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[key] = (tenant, entry)
            self._tenant_use[tenant] = self._tenant_use.get(tenant, 0) + entry.cost
            self.bytes += entry.cost
            return True


class GrammarBuilder:
    """The replica's side of a validated grammar: its matcher, compiled on a few background threads.

    llguidance drops the GIL while it compiles, so the event loop and the engine thread run on; the
    threads are niced (the decode loop wins a shared core), except one for grammars the worker timed
    under QUICK_BUILD_S, and have a REPLICA_STACK_BYTES stack, 8x
    the worker's compile thread (the compile is deterministic: what compiled there cannot overflow
    here). The cost is what the worker just spent, within its time and memory limits. Builds wait
    in per-tenant queues taken round robin (handler.threads.FairThreadPool), a tenant on at most all
    threads but one: another tenant's build never waits behind one tenant's stream of slow ones."""

    # a grammar whose worker compile and test-run took less than this is built at the serving loop's
    # priority on a thread of its own: bounded work (the build is deterministic and cheaper than what
    # the worker timed), which niced would wait behind every other runnable thread on a busy host
    QUICK_BUILD_S = 0.02

    def __init__(self, tokenizer, vocab_size: int, nice: int = 10, threads: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.nice = nice
        self.threads = max(1, int(threads))
        self._pool: FairThreadPool | None = None
        self._quick: FairThreadPool | None = None

    def start(self) -> None:
        """Build the llguidance tokenizer and the threads (call once, off the event loop)."""
        self.llt = ll_tokenizer(self.tokenizer, self.vocab_size)
        # a tenant's builds follow its worker compiles (at most workers - 1 at once): the caps are
        # a backstop, not the limit a tenant meets
        self._pool = FairThreadPool(self.threads, name="lorafarm-grammar", tenant_cap=64, total_cap=1024,
                                    nice=self.nice, stack_bytes=REPLICA_STACK_BYTES).start()
        self._quick = FairThreadPool(1, name="lorafarm-grammar-quick", tenant_cap=64, total_cap=1024,
                                     nice=0, stack_bytes=REPLICA_STACK_BYTES).start()

    def _build(self, grammar: str, cost: int) -> CompiledGrammar:
        base = new_base_matcher(self.llt, grammar)
        if base.is_error():
            raise ValueError(f"the grammar does not compile: {base.get_error()}")
        return CompiledGrammar(grammar, base, len(grammar) + max(int(cost), 2 * len(grammar)))

    async def build(self, grammar: str, cost: int, tenant: str = "-", compile_s: float | None = None) -> CompiledGrammar:
        """The matcher of a validated grammar, built in `tenant`'s turn (handler.threads.QueueFull
        when the tenant has too many builds waiting); on the un-niced thread when the worker's
        `compile_s` says it is quick."""
        quick = compile_s is not None and compile_s < self.QUICK_BUILD_S
        return await (self._quick if quick else self._pool).run(tenant, 1, self._build, grammar, cost)

    async def trim(self) -> None:
        """malloc_trim on a build thread: after evictions, the freed matchers' memory goes back
        to the OS instead of staying in the allocator's arenas."""
        await self._pool.run("(trim)", 1, malloc_trim)

    def stats(self) -> dict:
        return self._pool.stats() if self._pool is not None else {}

    def close(self) -> None:
        for pool in (self._pool, self._quick):
            if pool is not None:
                pool.close()


def malloc_trim() -> None:
    """Give the allocator's free memory back to the OS (glibc's malloc_trim; a no-op elsewhere): after
    a worker's job (handler.grammar.pool) and after the replica's cache evicted matchers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_compiled: OrderedDict[tuple[str, int], Any] = OrderedDict()
_compiled_bytes = 0
_COMPILED_MAX_BYTES = 64 * 1024**2  # in-process compiles (str grammars): by grammar text, LRU


def new_matcher(grammar: str | CompiledGrammar, tokenizer, vocab_size: int):
    """A fresh matcher for one request. A CompiledGrammar (what the replica serves with) is deep-
    copied; a grammar string is compiled here, in this process (tests and tools; the serving path
    never passes one), and kept in a small LRU bounded by grammar bytes.
    ValueError when the grammar does not compile (e.g. an unsupported JSON-schema keyword)."""
    global _compiled_bytes
    if isinstance(grammar, CompiledGrammar):
        return grammar.matcher()
    llt = ll_tokenizer(tokenizer, vocab_size)
    key = (grammar, id(llt))
    with _lock:
        base = _compiled.get(key)
        if base is not None:
            _compiled.move_to_end(key)
    if base is None:
        base = new_base_matcher(llt, grammar)
        if base.is_error():
            raise ValueError(f"the grammar does not compile: {base.get_error()}")
        with _lock:
            if key not in _compiled:
                _compiled[key] = base
                _compiled_bytes += 16 * len(grammar)
            while _compiled_bytes > _COMPILED_MAX_BYTES and len(_compiled) > 1:
                (g, _), _m = _compiled.popitem(last=False)
                _compiled_bytes -= 16 * len(g)
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


def allowed_tokens(matchers: list, vocab_size: int) -> "torch.Tensor":
    """bool [len(matchers), vocab_size]: the tokens each matcher allows next (a matcher in an error
    state, which should not happen, allows everything, with a warning)."""
    global _BITS
    import torch

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
    if bool(stuck.any()):  # a matcher in an error state: sample anything rather than from nothing; the
        # engine ends the row with an error on this token (sampling.RowState.grammar_error)
        allowed[stuck] = True
    return allowed


_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


def parse_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Split a generated answer into its text content (None when empty) and its tool calls as
    (name, arguments JSON). A complete block that is not a call object stays in the content; a
    `<tool_call>` block cut off before its `</tool_call>` (max_tokens) is dropped: a partial call is
    never content (the finish_reason, "length", says the answer was cut)."""
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
    content.append(_without_cut_call(text[pos:]))
    body = "".join(content).strip() if calls else "".join(content)
    return (body or None), calls


def _without_cut_call(tail: str) -> str:
    """`tail` (text after the last complete call) up to an unterminated `<tool_call>`, if any."""
    start = tail.rfind(TOOL_CALL_OPEN)
    if start >= 0 and tail.find(TOOL_CALL_CLOSE, start) < 0:
        return tail[:start]
    return tail[: len(tail) - _open_prefix(tail, least=2)]


def _open_prefix(text: str, least: int = 1) -> int:
    """The length of the longest tail of `text` (>= least chars) that starts a `<tool_call>` tag."""
    return next((k for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), least - 1, -1)
                 if TOOL_CALL_OPEN.startswith(text[-k:])), 0)


class ToolCallStream:
    """Streams an answer under tools: text goes out as content, except text that is or may become a
    `<tool_call>` block, which is held back until its `</tool_call>`; then the call goes out whole as
    one OpenAI `tool_calls` delta entry (index, id, type, function name and arguments).

        ts = ToolCallStream(new_id)
        content, calls = ts.feed(text)     # calls: [(index, id, name, arguments JSON)]
        content, calls = ts.close()        # at the end: what is held back (never a cut-off call)
    """

    def __init__(self, new_id):
        self.new_id = new_id
        self.buf = ""
        self.calls = 0
        self.dropped = ""  # the cut-off call block close() dropped, if any

    def _drain(self, final: bool) -> tuple[str, list]:
        content, calls = "", []
        while self.buf:
            start = self.buf.find(TOOL_CALL_OPEN)
            if start < 0:
                # hold back a tail that may be the start of a call block
                keep = _open_prefix(self.buf)
                if final:  # a tag cut off by max_tokens ("<tool_c") is dropped as a cut call is
                    keep = _open_prefix(self.buf, least=2)
                    self.dropped, self.buf = self.buf[len(self.buf) - keep:], self.buf[: len(self.buf) - keep]
                    keep = 0
                content += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                content += self.buf[:start]
                self.buf = self.buf[start:]
                if final:  # a call cut off (max_tokens) is dropped, never sent as content
                    self.dropped = self.buf
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
