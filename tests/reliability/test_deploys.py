"""Item 8: deploys are read-your-writes. A request sent the moment the registry call returns (alias
set, upload with --alias, rollback) is served by the new version, never 404 or the old one."""

from __future__ import annotations

import concurrent.futures as cf
import time

import openai
import pytest

from tests.reliability.conftest import client, reg_call

MSG = [{"role": "user", "content": "hello"}]


def _ask(rfarm, key, model):
    r = client(rfarm, key).chat.completions.create(model=model, messages=MSG, max_tokens=24, temperature=0)
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def two(rtenant, markers):
    (a_alias, a), (b_alias, b) = sorted(rtenant["aliases"].items())[:2]
    return {"a": a, "b": b, "marker": {a: markers[a_alias], b: markers[b_alias]}}


def test_new_alias_is_served_at_once(rfarm, rtenant, two):
    for i in range(4):
        alias, target = f"demo/ryw{i}:prod", (two["a"], two["b"])[i % 2]
        reg_call(rfarm, lambda reg: reg.set_alias(alias, target))
        assert _ask(rfarm, rtenant["api_key"], alias) == two["marker"][target]


def test_alias_flip_and_rollback_are_read_your_writes(rfarm, rtenant, two):
    alias = "demo/flip:prod"
    reg_call(rfarm, lambda reg: reg.set_alias(alias, two["a"]))
    assert _ask(rfarm, rtenant["api_key"], alias) == two["marker"][two["a"]]
    for _ in range(3):
        reg_call(rfarm, lambda reg: reg.set_alias(alias, two["b"]))
        assert _ask(rfarm, rtenant["api_key"], alias) == two["marker"][two["b"]]
        reg_call(rfarm, lambda reg: reg.rollback_alias(alias))
        assert _ask(rfarm, rtenant["api_key"], alias) == two["marker"][two["a"]]


def test_upload_with_alias_is_served_at_once(rfarm, rtenant, canary_index):
    farm = rfarm["_farm"]
    name = sorted(canary_index)[0]
    alias = "demo/fresh:prod"
    reg_call(rfarm, lambda reg: reg.upload_adapter(farm.adapters_dir / name, "demo", alias=alias,
                                                   base_model="lorafarm-dev-tiny"))
    assert _ask(rfarm, rtenant["api_key"], alias) == canary_index[name]["marker"]


def test_unknown_names_refresh_once_then_404(rfarm, rtenant):
    """Many requests for a name nobody deployed: all 404, and the router asked the registry about
    it a bounded number of times (single flight, brief negative cache), not once per request."""
    from tests.reliability.test_defects import _metric

    before = _metric(rfarm["router_url"], "lorafarm_router_registry_calls_total", 'kind="routing_miss"')

    c = client(rfarm, rtenant["api_key"])

    def one(_):
        try:
            c.chat.completions.create(model="demo/never-deployed:prod", messages=MSG, max_tokens=4)
        except openai.NotFoundError as e:
            return e.code
        return "served"

    started = time.monotonic()
    with cf.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(40)))
    elapsed = time.monotonic() - started
    assert codes == ["model_not_found"] * 40
    fetches = _metric(rfarm["router_url"], "lorafarm_router_registry_calls_total", 'kind="routing_miss"') - before
    # one fetch, then at most one per negative-cache period (1 s) however many requests came
    assert 1 <= fetches <= 2 + elapsed / 1.0, (fetches, elapsed)
    assert fetches < len(codes) / 4
