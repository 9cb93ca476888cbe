"""The engine with a grammar that hits a parser limit mid-generation (no adapters needed)."""

from __future__ import annotations

import pytest

from handler.grammar import constrained
from handler.engine.engine import Engine, SamplingParams
from tests.handler.test_engine import Collector, chat_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(dev_model):
    return Engine(dev_model, rank_pools={8: 1}, max_batch=8)


def test_a_parser_limit_mid_generation_ends_the_row_with_an_error_not_stop(engine):
    """Issue 21: a schema that compiles but hits llguidance's parser limit after the first `{` (1,000
    optional properties) used to end "stop" with content `{`. The engine ends such a row with an
    error ("grammar: ..."), which the replica answers as 400 invalid_schema / an error event. (The
    replica refuses this schema before generation: the worker's test-run finds the limit; this is
    the engine's bound for a limit that shows only later.)"""
    tok = engine.tokenizer
    props = {f"p{i}": {"type": "integer"} for i in range(1000)}
    grammar = constrained.json_schema_grammar({"type": "object", "properties": props})
    ids = chat_ids(tok, "a record")
    col = Collector()
    for i in range(3):
        engine.add_request(f"lim{i}", ids, SamplingParams(max_tokens=32, temperature=1.0, seed=i, grammar=grammar),
                           None, col)
    engine.add_request("free", ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), None, col)
    while engine.has_work():
        engine.step()
    for i in range(3):
        last = col.final(f"lim{i}")
        assert last.finish_reason == "error" and last.error.startswith("grammar: "), last
        assert "".join(e.text for e in col.events[f"lim{i}"]) in ("", "{")  # nothing past the failure
    assert col.final("free").finish_reason == "length"  # the batch's other rows are untouched
