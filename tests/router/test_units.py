"""Rate limiter, SLO tracker, auth cache, catalog, request parsing."""

import asyncio
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.auth import AuthCache, AuthUnavailable, InvalidApiKey
from router.catalog import Catalog, ModelNotFound
from router.config import RouterSettings
from router.openai_api import CHAT, COMPLETIONS, ApiError, parse_request
from router.ratelimit import RateLimiter
from router.slo import SloTracker, percentile
from router.view import ReplicaView
from tests.router.doubles import FakeRegistry, base_hash


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


# -- rate limiter -------------------------------------------------------------------------------


def test_request_bucket_burst_then_refill():
    clock = Clock()
    rl = RateLimiter(burst_seconds=1.0, clock=clock)
    results = [rl.check("a", requests_per_s=5, tokens_per_s=None, tokens=10) for _ in range(8)]
    assert [r.allowed for r in results] == [True] * 5 + [False] * 3
    denied = results[-1]
    assert denied.headers["retry-after"] == "1"
    assert 0 < denied.retry_after <= 0.2 + 1e-9
    assert denied.headers["x-ratelimit-limit-requests"] == "5"
    assert denied.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in denied.headers
    clock.t += 0.2
    assert rl.check("a", requests_per_s=5, tokens_per_s=None, tokens=10).allowed
    assert not rl.check("a", requests_per_s=5, tokens_per_s=None, tokens=10).allowed


def test_tenants_are_independent_and_none_is_unlimited():
    rl = RateLimiter(clock=Clock())
    for _ in range(3):
        rl.check("a", requests_per_s=1, tokens_per_s=None, tokens=1)
    assert not rl.check("a", requests_per_s=1, tokens_per_s=None, tokens=1).allowed
    assert rl.check("b", requests_per_s=1, tokens_per_s=None, tokens=1).allowed
    assert all(rl.check("c", requests_per_s=None, tokens_per_s=None, tokens=10**6).allowed for _ in range(100))


def test_token_bucket_counts_prompt_plus_max_tokens_and_nothing_taken_on_deny():
    clock = Clock()
    rl = RateLimiter(clock=clock)
    assert rl.check("a", requests_per_s=100, tokens_per_s=1000, tokens=600).allowed
    r = rl.check("a", requests_per_s=100, tokens_per_s=1000, tokens=600)
    assert not r.allowed and r.retry_after == pytest.approx(0.2)
    assert r.headers["x-ratelimit-remaining-tokens"] == "400"
    assert r.headers["x-ratelimit-remaining-requests"] == "99"  # the denied request took nothing
    clock.t += 0.2
    assert rl.check("a", requests_per_s=100, tokens_per_s=1000, tokens=600).allowed


def test_oversized_request_fits_a_full_bucket_then_debt():
    clock = Clock()
    rl = RateLimiter(clock=clock)
    assert rl.check("a", requests_per_s=None, tokens_per_s=100, tokens=500).allowed
    r = rl.check("a", requests_per_s=None, tokens_per_s=100, tokens=1)
    assert not r.allowed and r.retry_after == pytest.approx(4.01)
    assert r.headers["retry-after"] == "5"


def test_settle_refunds_unused_estimate():
    clock = Clock()
    rl = RateLimiter(clock=clock)
    assert rl.check("a", requests_per_s=None, tokens_per_s=1000, tokens=900).allowed
    assert not rl.check("a", requests_per_s=None, tokens_per_s=1000, tokens=900).allowed
    rl.settle("a", 900, 100)
    assert rl.check("a", requests_per_s=None, tokens_per_s=1000, tokens=900).allowed


def test_limit_change_applies():
    clock = Clock()
    rl = RateLimiter(clock=clock)
    rl.check("a", requests_per_s=10, tokens_per_s=None, tokens=0)
    r = rl.check("a", requests_per_s=2, tokens_per_s=None, tokens=0)
    assert r.headers["x-ratelimit-limit-requests"] == "2"


# -- SLO ----------------------------------------------------------------------------------------


def test_percentile_nearest_rank():
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([7.0], 95) == 7.0


def test_slo_breach_logged_and_gauge_updated(caplog):
    clock = Clock()
    updates = {}
    slo = SloTracker(target=1.0, window=60, min_samples=10, clock=clock,
                     on_update=lambda t, p, b: updates.__setitem__(t, (p, b)))  # fmt: skip
    for i in range(20):
        slo.record("fast", 0.1)
        slo.record("slow", 0.5 if i < 15 else 3.0)  # p95 = 3.0
    with caplog.at_level(logging.WARNING, logger="lorafarm.router.slo"):
        out = slo.evaluate()
    assert out["slow"].breached and out["slow"].p95 == 3.0
    assert not out["fast"].breached
    assert updates["slow"] == (3.0, True) and updates["fast"] == (0.1, False)
    assert any("tenant slow TTFT p95 3.000 s above" in m for m in caplog.messages)
    assert not any("fast" in m for m in caplog.messages)
    # not re-logged every second while it stays breached
    caplog.clear()
    clock.t += 1
    with caplog.at_level(logging.WARNING, logger="lorafarm.router.slo"):
        slo.evaluate()
    assert not caplog.messages
    # window slides: old slow samples fall out, the tenant recovers and is forgotten
    clock.t += 61
    slo.evaluate()
    assert updates["slow"] == (None, False)
    assert slo.p95("slow") is None


def test_slo_needs_min_samples():
    slo = SloTracker(target=0.5, min_samples=5, clock=Clock())
    for _ in range(4):
        slo.record("t", 9.0)
    assert not slo.evaluate()["t"].breached


# -- auth cache ---------------------------------------------------------------------------------


async def test_auth_cache_ttl_negative_cache_and_single_flight():
    clock = Clock()
    calls = []

    async def verify(key):
        calls.append(key)
        await asyncio.sleep(0.01)
        return {"tenant_id": "acme", "key_id": "k1", "requests_per_s": 5, "tokens_per_s": None} if key == "good" else None

    cache = AuthCache(verify, ttl=30, negative_ttl=5, clock=clock)
    tenants = await asyncio.gather(*(cache.tenant_for("good") for _ in range(10)))
    assert {t.tenant_id for t in tenants} == {"acme"} and tenants[0].requests_per_s == 5.0
    assert calls == ["good"]  # ten concurrent requests, one registry call
    await cache.tenant_for("good")
    assert calls == ["good"]
    clock.t += 31
    await cache.tenant_for("good")
    assert calls == ["good", "good"]
    for _ in range(3):
        with pytest.raises(InvalidApiKey):
            await cache.tenant_for("bad")
    assert calls.count("bad") == 1
    clock.t += 6
    with pytest.raises(InvalidApiKey):
        await cache.tenant_for("bad")
    assert calls.count("bad") == 2
    with pytest.raises(InvalidApiKey):
        await cache.tenant_for("")


async def test_auth_cache_registry_down():
    clock = Clock()
    state = {"down": False}
    calls = []

    async def verify(key):
        calls.append(key)
        if state["down"]:
            raise ConnectionError("registry down")
        return {"tenant_id": "acme"}

    cache = AuthCache(verify, ttl=10, stale_grace=100, clock=clock)
    await cache.tenant_for("k")
    state["down"] = True
    clock.t += 50  # expired, registry down, within grace: the cached tenant still works
    assert (await cache.tenant_for("k")).tenant_id == "acme"
    assert cache.registry_down and len(calls) == 2
    clock.t += 40  # known down: served from the cache without a registry call on the request path
    assert (await cache.tenant_for("k")).tenant_id == "acme" and len(calls) == 2
    clock.t += 20  # 110 s since the registry last answered: 503
    with pytest.raises(AuthUnavailable):
        await cache.tenant_for("k")
    with pytest.raises(AuthUnavailable):  # never-seen key: 503, not a 401 it did not earn
        await cache.tenant_for("other")
    state["down"] = False
    cache.registry_answered()  # the routing poll got through again: keys are checked again
    assert (await cache.tenant_for("k")).tenant_id == "acme" and len(calls) == 4


async def test_auth_cache_never_caches_a_key_the_table_lists_as_revoked():
    """A verification that raced the revocation (answered valid, arriving after the routing table
    that revokes the key was applied) is not cached: the key is refused."""
    async def verify(key):
        return {"tenant_id": "acme", "key_id": "k1"}

    cache = AuthCache(verify, ttl=30, clock=Clock())
    assert (await cache.tenant_for("sk-1")).key_id == "k1"
    assert cache.revoke_key_ids(["k1"]) == 1
    with pytest.raises(InvalidApiKey):
        await cache.tenant_for("sk-1")


# -- catalog ------------------------------------------------------------------------------------


def _catalog():
    reg = FakeRegistry()
    a = reg.add_adapter("acme", "support", "dev-a", alias="acme/support:prod")
    b = reg.add_adapter("beta", "sales", "dev-b", alias="beta/sales:prod")
    reg.add_replica("r0", "http://r0", "dev-a")
    reg.add_replica("r1", "http://r1", "dev-a")
    reg.add_replica("r2", "http://r2", "dev-b")
    view = ReplicaView(None)
    view.apply_table(reg.table())
    return reg, view, Catalog(view), a, b


def test_catalog_union_dedup_and_aliases_with_parent():
    reg, view, cat, a, b = _catalog()
    acme = cat.models_for("acme")
    assert acme["object"] == "list"
    ids = [m["id"] for m in acme["data"]]
    assert ids == ["dev-a", "dev-b", "acme/support:prod"]  # union de-duplicated, own adapters once (by alias)
    alias = acme["data"][2]
    assert alias["parent"] == "dev-a" and alias["root"] == alias["adapter_id"] == a and alias["owned_by"] == "acme"
    assert cat.model_for("acme", a)["id"] == a  # an aliased adapter's id still answers
    assert "beta/sales:prod" not in ids
    assert [m["id"] for m in cat.models_for("nobody")["data"]] == ["dev-a", "dev-b"]


def test_catalog_lists_each_adapter_once_under_the_name_it_is_deployed_as():
    """One entry per model a caller would use: an aliased adapter under its alias (one entry per
    alias), an adapter no alias points at (an older version) under its id; ids stay retrievable."""
    reg, view, cat, a, b = _catalog()
    old = reg.add_adapter("acme", "support-v0", "dev-a")  # no alias: callable by id only
    reg.set_alias("acme/support:canary", a)  # a second alias on the same adapter
    view.apply_table(reg.table())
    data = cat.models_for("acme")["data"]
    ids = [m["id"] for m in data]
    assert ids.count(a) == 0 and ids.count(old) == 1
    assert sorted(i for i in ids if i.startswith("acme/")) == ["acme/support:canary", "acme/support:prod"]
    by_root = {}
    for m in data:
        if "root" in m:
            by_root.setdefault(m["root"], []).append(m["id"])
            assert m["adapter_id"] == m["root"]
    assert {r: sorted(v) for r, v in by_root.items()} == {a: ["acme/support:canary", "acme/support:prod"], old: [old]}
    assert cat.model_for("acme", a)["root"] == a and cat.model_for("acme", old)["id"] == old
    with pytest.raises(ModelNotFound):
        cat.model_for("acme", b)  # another tenant's adapter, by id


def test_catalog_follows_the_view():
    reg, view, cat, a, b = _catalog()
    reg.remove_replica("r2")
    view.apply_table(reg.table())
    assert [m["id"] for m in cat.models_for("acme")["data"]] == ["dev-a", "acme/support:prod"]


def test_resolution_is_tenant_scoped():
    reg, view, cat, a, b = _catalog()
    r = cat.resolve("acme", "acme/support:prod")
    assert (r.kind, r.adapter_id, r.upstream_model, r.base_model_hash) == ("adapter", a, a, base_hash("dev-a"))
    assert cat.resolve("acme", a).adapter_id == a
    base = cat.resolve("acme", "dev-b")
    assert (base.kind, base.upstream_model) == ("base", "dev-b")
    messages = set()
    for model in ["beta/sales:prod", b, "acme/nosuch:prod", "ad-00000000000000000000", "gpt-4"]:
        with pytest.raises(ModelNotFound) as exc:
            cat.resolve("acme", model)
        messages.add(str(exc.value).replace(model, "X"))
    assert len(messages) == 1  # the same answer whether the name exists or not


def test_inactive_adapter_is_not_found():
    reg, view, cat, a, b = _catalog()
    reg.adapters[a]["status"] = "deleted"
    view.apply_table(reg.table())
    with pytest.raises(ModelNotFound):
        cat.resolve("acme", "acme/support:prod")


# -- request parsing ----------------------------------------------------------------------------


def test_parse_and_estimate():
    p = parse_request(CHAT, b'{"model":"m","messages":[{"role":"user","content":"abcdefgh"}],"max_tokens":10}', 256)
    assert (p.prompt_tokens, p.max_tokens, p.cost, p.stream) == (6, 10, 16, False)
    # no max_tokens field on a completion: its schema's default (16), whatever the chat default
    p = parse_request(COMPLETIONS, b'{"model":"m","prompt":[1,2,3],"n":2,"stream":true}', 100)
    assert (p.prompt_tokens, p.cost, p.stream) == (3, 35, True)
    p = parse_request(COMPLETIONS, b'{"model":"m","prompt":[1,2,3],"max_tokens":null}', 100)
    assert (p.max_tokens, p.cost) == (100, 103)


@pytest.mark.parametrize("endpoint, body", [
    (CHAT, {}), (CHAT, {"max_tokens": 40}), (CHAT, {"max_completion_tokens": 7}), (CHAT, {"max_tokens": None}),
    (CHAT, {"max_tokens": 40, "max_completion_tokens": 1}), (CHAT, {"max_tokens": 1, "max_completion_tokens": 40}),
    (COMPLETIONS, {}), (COMPLETIONS, {"max_tokens": 99}), (COMPLETIONS, {"max_tokens": None}),
])
def test_the_router_charges_what_the_replica_generates(endpoint, body):
    """One max_tokens rule (lorafarm.openai_schemas.effective_max_tokens): the router's charge is the limit
    the replica's schema resolves, or the one default (512, the replica's) where none is sent."""
    from lorafarm import openai_schemas as oai

    if endpoint == CHAT:
        full, model = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}, oai.ChatCompletionRequest
    else:
        full, model = {"model": "m", "prompt": "x", **body}, oai.CompletionRequest
    replica = oai.parse_request(model, full).max_tokens  # None: the replica's default applies
    charged = parse_request(endpoint, json.dumps(full).encode(), RouterSettings().default_max_tokens).max_tokens
    assert charged == (oai.DEFAULT_MAX_TOKENS if replica is None else replica)
    assert RouterSettings().default_max_tokens == oai.DEFAULT_MAX_TOKENS == 512


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"not json", None),
        (b"[]", None),
        (b'{"messages":[{"role":"user","content":"x"}]}', "model"),
        (b'{"model":"m"}', "messages"),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}', "max_tokens"),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}', "stream"),
        # unbounded ints would be charged and counted as in-flight tokens (a 400-digit max_tokens
        # once overflowed the router's float gauges)
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":' + b"9" * 400 + b"}", "max_tokens"),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":2147483648}',
         "max_completion_tokens"),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"n":129}', "n"),
    ],
)
def test_parse_rejects(raw, param):
    with pytest.raises(ApiError) as exc:
        parse_request(CHAT, raw, 16)
    assert exc.value.status == 400 and exc.value.param == param
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


# -- SSE relay helpers --------------------------------------------------------------------------


def test_usage_scanner_and_event_boundary():
    from router.proxy import UsageScanner, _event_boundary

    assert _event_boundary(b"data: a\n\ndata: b") == len(b"data: a\n\n")
    assert _event_boundary(b"data: a\r\n\r\n") == len(b"data: a\r\n\r\n")
    assert _event_boundary(b"data: partial") == 0
    sc = UsageScanner()
    sc.feed_events(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
    assert sc.first_token_at is None  # the role chunk is not a token
    sc.feed_events(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n')
    assert sc.first_token_at is not None
    sc.feed_events(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
                   b"data: [DONE]\n\n")  # fmt: skip
    assert sc.usage["total_tokens"] == 5 and sc.content_events == 2
    legacy = UsageScanner()
    legacy.feed_events(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n')
    assert legacy.first_token_at is not None


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.5, 50),
    gaps=st.lists(st.floats(0, 0.5), min_size=1, max_size=80),
)
def test_bucket_never_admits_more_than_capacity_plus_refill(rate, gaps):
    clock = Clock(0.0)
    rl = RateLimiter(burst_seconds=1.0, clock=clock)
    admitted = 0
    for gap in gaps:
        clock.t += gap
        r = rl.check("t", requests_per_s=rate, tokens_per_s=None, tokens=0)
        admitted += r.allowed
        if not r.allowed:
            assert r.retry_after > 0 and int(r.headers["retry-after"]) >= 1
    assert admitted <= max(rate, 1.0) + rate * clock.t + 1e-6
