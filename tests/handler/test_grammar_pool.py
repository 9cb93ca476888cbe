"""The grammar worker pool (handler.grammar.pool) with real worker processes: crashes, timeouts and
parser limits fail only their own job, the pool respawns, and the replica-side cache is bounded by
bytes per tenant."""

from __future__ import annotations

import asyncio

import pytest

from handler.grammar import constrained
from handler.grammar.pool import FAULT_ENV, FAULT_TITLE, GrammarError, GrammarPool
from tests.waiting import wait_until


def ref_chain(n: int) -> dict:
    """The issue's poison schema: a $defs chain of n $ref links (n=1,000: ~100 KB; SIGSEGV in-process)."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def many_properties(n: int, required: bool = False, prefix: str = "p") -> dict:
    props = {f"{prefix}{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


RECURSIVE_REQUIRED = {"$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}},
                                         "required": ["child"]}}, "$ref": "#/$defs/node"}


@pytest.fixture(scope="module")
def tokenizer(dev_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(dev_model))


def run(coro):
    return asyncio.run(coro)


async def _pool(tokenizer, **kw) -> GrammarPool:
    pool = GrammarPool(constrained.tokenizer_spec(tokenizer, len(tokenizer)), **kw)
    await pool.start()
    return pool


def test_poison_schemas_fail_alone_and_the_pool_respawns(tokenizer, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "segv")  # read only in the worker processes

    async def main():
        pool = await _pool(tokenizer, workers=2, timeout_s=20)
        try:
            pids = set(pool.pids())
            ok = await pool.compile({"kind": "json_schema", "schema": {"type": "object", "properties": {
                "a": {"type": "integer"}}, "required": ["a"]}})
            assert "json_schema" in ok.grammar and ok.cost >= 0
            # the 1,000-link $ref chain overflows llguidance's stack: the worker dies, only this job fails
            with pytest.raises(GrammarError) as e:
                await pool.compile({"kind": "json_schema", "schema": ref_chain(1000)})
            assert e.value.limit == "crash" and "SIGSEGV" in str(e.value)
            # the deliberate fault (test-only env var, read in the worker): SIGSEGV
            with pytest.raises(GrammarError) as e:
                await pool.compile({"kind": "json_schema", "schema": {"title": FAULT_TITLE, "type": "object"}})
            assert e.value.limit == "crash" and "SIGSEGV" in str(e.value)
            # parser limits show in the test-run: 400 before generation
            for schema in (many_properties(1000), RECURSIVE_REQUIRED):
                with pytest.raises(GrammarError) as e:
                    await pool.compile({"kind": "json_schema", "schema": schema})
                assert e.value.limit == "parser_limit", e.value
            # a tool whose parameters hit a limit is refused too (probed on their own)
            tool = {"type": "function", "function": {"name": "f", "parameters": many_properties(1000)}}
            with pytest.raises(GrammarError):
                await pool.compile({"kind": "tools", "tools": [tool], "choice": "auto", "parallel": True})
            with pytest.raises(GrammarError) as e:
                await pool.compile({"kind": "json_schema", "schema": {"type": "object", "minProperties": "x"}})
            # respawned: still serving, with new processes in place of the dead ones
            for _ in range(3):
                r = await pool.compile({"kind": "json_schema", "schema": many_properties(20, required=True)})
                assert r.grammar
            assert pool.failures["crash"] == 2 and pool.respawns >= 2
            # respawning starts a process and builds its tokenizer: seconds on a busy box, so wait on
            # the pool's own count up to a generous deadline, not a fixed 5 s
            await wait_until(lambda: pool.alive == 2, 120, interval=0.05, what="two grammar processes alive")
            assert pool.alive == 2 and len(pids & set(pool.pids())) <= 1
        finally:
            await pool.close()
        assert pool.alive == 0

    run(main())


def test_timeout_and_memory_limits_name_their_flag(tokenizer, monkeypatch):
    async def main(fault, **kw):
        monkeypatch.setenv(FAULT_ENV, fault)
        pool = await _pool(tokenizer, workers=1, **kw)
        try:
            with pytest.raises(GrammarError) as e:
                await pool.compile({"kind": "json_schema", "schema": {"title": FAULT_TITLE, "type": "object"}})
            r = await pool.compile({"kind": "json_object"})  # the respawned worker serves the next job
            assert r.grammar
            return e.value
        finally:
            await pool.close()

    err = run(main("hang", timeout_s=1.0))
    assert err.limit == "timeout" and "--grammar-timeout-s" in str(err)
    err = run(main("memory", timeout_s=30, memory_bytes=256 * 1024**2))
    assert err.limit == "memory" and "--grammar-memory-bytes" in str(err), err


def test_a_regex_that_expands_without_end_is_refused_by_fuel_not_by_the_timeout(tokenizer):
    """Issue 35's flood schema (`^(a{1000}){N}$`) ran its test masks for seconds (3.5 s at N=300 with
    llguidance's default lexer fuel), until the worker was killed at --grammar-timeout-s and respawned.
    Under INITIAL_LEXER_FUEL it is a parser_limit refusal with the worker kept, while schemas people
    send (a 3,000-string enum, 200 required properties of mixed types, formats, patterns, nesting;
    10,000 required properties in test_grammar_replica) still compile."""
    words = [f"w{i}x{i * 7 % 13}" for i in range(3000)]
    legit = [
        {"type": "string", "enum": words},
        {"type": "object", "properties": {f"p{i}": {"type": ["string", "integer", "null"]} for i in range(200)},
         "required": [f"p{i}" for i in range(200)]},
        {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                          "at": {"type": "string", "format": "date-time"},
                                          "id": {"type": "string", "format": "uuid"},
                                          "phone": {"type": "string", "pattern": "^\\+?[0-9]{1,3}[- ]?[0-9]{3}[- ]?[0-9]{4}$"},
                                          "bio": {"type": "string", "minLength": 10, "maxLength": 500}},
         "required": ["email", "at", "id", "phone", "bio"]},
        {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {
            "b": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 50},
            "c": {"type": "string", "pattern": "^[A-Z]{2,10}-[0-9]{1,6}$"}}, "required": ["b", "c"]}}},
         "required": ["a"]},
    ]

    async def main():
        pool = await _pool(tokenizer, workers=1, timeout_s=600)  # no timeout can refuse it here
        try:
            pids = pool.pids()
            for n in (300, 301, 1300):
                with pytest.raises(GrammarError) as e:
                    await pool.compile({"kind": "json_schema", "schema": {"type": "string", "pattern": "^(a{1000}){%d}$" % n}})
                assert e.value.limit == "parser_limit" and "too many expressions" in str(e.value), e.value
            for schema in legit:
                assert (await pool.compile({"kind": "json_schema", "schema": schema})).grammar
            assert pool.pids() == pids and pool.respawns == 0  # one worker did all of it
        finally:
            await pool.close()

    run(main())


def test_grammar_cache_is_bounded_by_bytes_and_per_tenant():
    cache = constrained.GrammarCache(max_bytes=1000, tenant_bytes=400)

    def entry(cost):
        return constrained.CompiledGrammar("g", None, cost)

    assert cache.put("a1", "A", entry(150)) and cache.put("a2", "A", entry(150))
    assert cache.put("a3", "A", entry(150))  # A over its 400: A's oldest goes
    assert cache.get("a1") is None and cache.tenant_bytes_used("A") == 300
    assert not cache.put("huge", "B", entry(401))  # larger than a tenant's share: not kept
    for i in range(3):
        cache.put(f"b{i}", "B", entry(130))
    for i in range(3):
        cache.put(f"c{i}", "C", entry(130))
    assert cache.bytes <= 1000 and cache.get("a2") is None  # the global LRU went next
    assert sum(cache.tenant_bytes_used(t) for t in "ABC") == cache.bytes


def test_cut_off_tool_calls_never_become_content():
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    for tail in ('\n<tool_call>{"name": "f", "argu', "\n<tool_c", "\n<tool_call>"):
        content, calls = constrained.parse_tool_calls(call + tail)
        assert content is None and calls == [("f", '{"x": 1}')]
        ts = constrained.ToolCallStream(lambda: "id")
        out = [ts.feed(ch) for ch in call + tail] + [ts.close()]
        assert "".join(c for c, _ in out) == ""
        assert [k for _, ks in out for k in ks] == [(0, "id", "f", '{"x": 1}')]
    # free text around calls (tool_choice auto) stays; a cut call after it does not
    content, calls = constrained.parse_tool_calls('Let me look. <tool_call>{"name": "f", "arg')
    assert content == "Let me look. " and calls == []
    assert constrained.parse_tool_calls("a < b") == ("a < b", [])


def test_a_quick_grammar_is_built_at_the_loops_priority_a_slow_one_niced(tokenizer):
    """The replica's matcher build: one whose worker compile took under QUICK_BUILD_S runs on the
    un-niced thread (on a busy host a niced thread waits behind every other runnable one: issue 35's
    grammar flood doubled a victim's small-schema request that way); a slower one, or one with no
    timing, on the niced pool. Both give a working matcher."""
    import os
    import threading

    builder = constrained.GrammarBuilder(tokenizer, len(tokenizer), nice=10, threads=1)
    builder.start()
    seen: list[tuple[str, int]] = []
    real = builder._build

    def spy(grammar, cost):
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(grammar, cost)

    builder._build = spy
    grammar = constrained.json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def main():
        for compile_s in (0.001, 0.5, None):
            compiled = await builder.build(grammar, 0, "t", compile_s)
            assert not compiled.matcher().is_error()

    try:
        run(main())
    finally:
        builder.close()
    (quick, quick_nice), (slow, slow_nice), (untimed, _) = seen
    assert quick.startswith("lorafarm-grammar-quick") and quick_nice == base
    assert not slow.startswith("lorafarm-grammar-quick") and slow_nice == max(base, 10)
    assert not untimed.startswith("lorafarm-grammar-quick")
