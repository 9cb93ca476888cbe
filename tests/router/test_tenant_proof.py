"""Issue 21, items 7-10 at the router, pure parts: worker key variables, foreign catalogs (base models
only), the endpoint check (embedding model vs chat model), 4xx for logit_bias keys, one `n` limit,
unknown embeddings fields, and the auth cache's stale grace while the registry is down."""

from __future__ import annotations

import json

import pytest

from lorafarm import openai_schemas as oai
from lorafarm import limits
from lorafarm.embeddings import EmbeddingsRequestError, parse_embeddings
from lorafarm.schemas import ReplicaState
from router.auth import AuthCache, AuthUnavailable
from router.catalog import Catalog, ModelNotFound
from router.config import RouterSettings
from router.openai_api import CHAT, COMPLETIONS, EMBEDDINGS, ApiError, parse_request
from router.view import ReplicaView
from router.workers import ForeignWorkers, looks_like_ours
from tests.router.doubles import FakeRegistry, base_hash

# -- 7: a worker's key comes only from LORAFARM_WORKER_KEY_* ---------------------------------------


@pytest.mark.parametrize("name", ["LORAFARM_ADMIN_TOKEN", "HOME", "AWS_SECRET_ACCESS_KEY", "GPU_BOX_KEY",
                                  "LORAFARM_WORKER_KEY_", "lorafarm_worker_key_x", "LORAFARM_WORKER_KEY_A-B"])
def test_worker_key_env_other_than_the_prefix_is_refused(name):
    assert limits.worker_key_env_error(name)
    assert limits.worker_key_env_error("LORAFARM_WORKER_KEY_GPU_BOX") is None


def test_router_never_sends_a_non_prefixed_variable(monkeypatch):
    monkeypatch.setenv("LORAFARM_ADMIN_TOKEN", "the-admin-token")
    monkeypatch.setenv("LORAFARM_WORKER_KEY_A", "worker-a-key")
    fw = ForeignWorkers()
    fw.apply([{"name": "evil", "url": "http://h:1", "kind": "openai", "api_key_env": "LORAFARM_ADMIN_TOKEN"},
              {"name": "home", "url": "http://h:2", "kind": "openai", "api_key_env": "HOME"},
              {"name": "a", "url": "http://h:3", "kind": "openai", "api_key_env": "LORAFARM_WORKER_KEY_A"}])
    base = {"authorization": "Bearer the-admin-token", "x-request-id": "r"}
    for rid in ("worker:evil", "worker:home"):
        h = fw.headers_for(rid, base)
        assert "authorization" not in h and "the-admin-token" not in json.dumps(h)
        assert fw.workers[rid].headers() == {}
    assert fw.headers_for("worker:a", base)["authorization"] == "Bearer worker-a-key"


# -- 8: foreign catalogs add base models only --------------------------------------------------------


def _catalog():
    reg = FakeRegistry()
    a = reg.add_adapter("acme", "support", "dev-a", alias="acme/support:prod")
    reg.add_replica("r0", "http://r0", "dev-a")
    reg.add_replica("e0", "http://e0", "enc")
    view = ReplicaView(None)
    view.apply_table(reg.table())
    return reg, view, a


def test_foreign_names_shaped_like_our_aliases_or_adapter_ids_are_skipped(caplog):
    from router.workers import _foreign_names

    assert looks_like_ours("acme/support:prod") and looks_like_ours("ad-0123456789abcdef0123")
    assert not looks_like_ours("llama3:8b") and not looks_like_ours("meta-llama/Llama-3.1-8B-Instruct")
    fw = ForeignWorkers()
    fw.apply([{"name": "evil", "url": "http://h:1", "kind": "openai"}])
    e = fw.workers["worker:evil"]
    listed = ["llama3:8b", "acme/support:prod", "beta/secret:prod", "ad-0123456789abcdef0123"]
    with caplog.at_level("WARNING", logger="lorafarm.router.workers"):
        installed, loaded = _foreign_names(e, listed, set(listed))
        _foreign_names(e, listed, set(listed))  # logged once per name
    assert installed == ["llama3:8b"] and loaded == {"llama3:8b"}
    assert sum("acme/support:prod" in r.message for r in caplog.records) == 1


def test_catalog_never_lists_or_resolves_a_foreign_name_that_is_ours():
    reg, view, a = _catalog()
    cat = Catalog(view)
    fw = ForeignWorkers()
    fw.apply([{"name": "evil", "url": "http://h:1", "kind": "openai"}])
    e = fw.workers["worker:evil"]
    # the exact names of the table (an adapter id is not alias-shaped only when it is ours: both skipped)
    e.installed, e.loaded, e.polled_ok = ("foreign-base", a, "acme/support:prod"), frozenset(), True
    cat.workers = fw
    fw.version += 1
    assert [m["id"] for m in cat.models_for("beta")["data"]] == ["dev-a", "enc", "foreign-base"]
    with pytest.raises(ModelNotFound):
        cat.resolve("beta", a)  # another tenant's adapter id stays not found, even if a worker lists it
    with pytest.raises(ModelNotFound):
        cat.resolve("beta", "acme/support:prod")
    assert cat.resolve("beta", "foreign-base").kind == "base"
    assert cat.resolve("acme", "acme/support:prod").adapter_id == a  # the owner still reaches its alias


# -- 9: the endpoint check ----------------------------------------------------------------------


def test_embedding_model_to_chat_and_chat_model_to_embeddings_are_client_mistakes():
    reg, view, a = _catalog()
    view.replicas["e0"].state = ReplicaState(replica_id="e0", base_model_hash=base_hash("enc"), models=["enc"],
                                             task="embed")
    view.replicas["r0"].state = ReplicaState(replica_id="r0", base_model_hash=base_hash("dev-a"), models=["dev-a"])
    view.catalog_version += 1
    cat = Catalog(view)
    enc = cat.resolve("acme", "enc")
    assert cat.wrong_endpoint(enc, embeddings=False)[1] == "model_not_chat"
    assert cat.wrong_endpoint(enc, embeddings=True) is None
    base = cat.resolve("acme", "dev-a")
    assert cat.wrong_endpoint(base, embeddings=True)[1] == "model_not_embedding"
    assert cat.wrong_endpoint(base, embeddings=False) is None
    alias = cat.resolve("acme", "acme/support:prod")
    assert cat.wrong_endpoint(alias, embeddings=True)[1] == "model_not_embedding"
    assert cat.wrong_endpoint(alias, embeddings=False) is None
    # the task is remembered when the embedding worker leaves routing: still the client's mistake
    view.replicas["e0"].health_failures = 99
    view.catalog_version += 1
    assert cat.wrong_endpoint(cat.resolve("acme", "enc"), embeddings=False)[1] == "model_not_chat"


# -- 9, 10: request validation ------------------------------------------------------------------


def _chat(**kw) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}).encode()


@pytest.mark.parametrize("bias", [{"²": 5}, {"٣": 1}, {"-1": 1}, {"1.5": 1}, {" 1": 1}, {"1" * 11: 1},
                                  {"1": 101}, {"1": "5"}, {"1": True}, [1, 2], "x",
                                  {str(i): 1 for i in range(301)}])
def test_bad_logit_bias_is_400_at_the_router_and_the_replica(bias):
    with pytest.raises(ApiError) as e:
        parse_request(CHAT, _chat(logit_bias=bias), 16)
    assert e.value.status == 400 and e.value.param == "logit_bias"
    with pytest.raises(oai.OpenAIError) as e2:
        oai.parse_request(oai.ChatCompletionRequest, json.loads(_chat(logit_bias=bias)))
    assert e2.value.status == 400 and (e2.value.param or "").startswith("logit_bias")


def test_good_logit_bias_passes_both():
    body = _chat(logit_bias={"12": -100, "7": 2.5})
    assert parse_request(CHAT, body, 16).body["logit_bias"] == {"12": -100, "7": 2.5}
    req = oai.parse_request(oai.ChatCompletionRequest, json.loads(body))
    assert req.logit_bias_ids() == {12: -100.0, 7: 2.5}


def test_one_limit_for_n_at_router_and_replica():
    assert limits.MAX_N == 16
    for endpoint, schema, body in ((CHAT, oai.ChatCompletionRequest, _chat),
                                   (COMPLETIONS, oai.CompletionRequest,
                                    lambda **kw: json.dumps({"model": "m", "prompt": "x", **kw}).encode())):
        assert parse_request(endpoint, body(n=limits.MAX_N), 16).n == limits.MAX_N
        assert oai.parse_request(schema, json.loads(body(n=limits.MAX_N))).n == limits.MAX_N
        with pytest.raises(ApiError) as e:
            parse_request(endpoint, body(n=limits.MAX_N + 1), 16)
        assert e.value.status == 400 and e.value.param == "n"
        with pytest.raises(oai.OpenAIError) as e2:
            oai.parse_request(schema, json.loads(body(n=limits.MAX_N + 1)))
        assert e2.value.status == 400 and e2.value.param == "n"


def test_unknown_embeddings_fields_are_refused_as_on_chat():
    ok = {"model": "e", "input": "x", "encoding_format": "float", "dimensions": 8, "user": "u"}
    assert parse_embeddings(ok).model == "e"
    with pytest.raises(EmbeddingsRequestError) as e:
        parse_embeddings({**ok, "temperature": 0.5})
    assert e.value.param == "temperature" and e.value.code == "unsupported_parameter"
    with pytest.raises(ApiError) as e2:
        parse_request(EMBEDDINGS, json.dumps({**ok, "nonsense": 1}).encode(), 16)
    assert e2.value.status == 400 and e2.value.param == "nonsense" and e2.value.code == "unsupported_parameter"
    with pytest.raises(oai.OpenAIError) as e3:  # chat: the same answer for an unknown field
        oai.parse_request(oai.ChatCompletionRequest, {**json.loads(_chat()), "nonsense": 1})
    assert e3.value.status == 400 and e3.value.code == "unsupported_parameter"


# -- 10: revocation grace as documented ---------------------------------------------------------


class _Clock:
    t = 1000.0

    def __call__(self):
        return self.t


async def test_registry_outage_verified_keys_serve_for_the_stated_bound_new_keys_get_503():
    """Issue 35 item 7, the one rule (docs/operations.md): a key this router verified keeps serving
    through a registry outage while the router heard from the registry within `auth_stale_grace`
    (300 s) - whatever the key's TTL (30 s) says; a key it never verified gets 503 auth_unavailable
    from the start; past the bound every key does."""
    s = RouterSettings(registry_url="http://x")
    assert (s.auth_ttl, s.auth_stale_grace) == (30.0, 300.0)  # docs/operations.md: 300 s
    clock = _Clock()
    down = {"v": False}

    async def verify(key):
        if down["v"]:
            raise ConnectionError("registry down")
        return {"tenant_id": "acme", "key_id": "k1"}

    cache = AuthCache(verify, ttl=s.auth_ttl, stale_grace=s.auth_stale_grace, clock=clock)
    await cache.tenant_for("sk-1")
    clock.t += 25.0
    cache.registry_answered()  # the last routing poll that got through
    down["v"] = True
    cache.registry_failed()  # the next one failed: the outage begins
    with pytest.raises(AuthUnavailable):  # never verified by this router: 503 from the start
        await cache.tenant_for("sk-new")
    for _ in range(29):  # 290 s of outage, the key's TTL long expired: it serves throughout
        clock.t += 10.0
        assert (await cache.tenant_for("sk-1")).tenant_id == "acme"
    clock.t += 11.0  # 301 s since the registry last answered: 503, never served on an older answer
    with pytest.raises(AuthUnavailable):
        await cache.tenant_for("sk-1")


async def test_a_big_body_is_parsed_off_the_event_loop_with_the_same_answers():
    import threading

    from router import openai_api

    body = json.dumps({"model": "e", "input": [[1] * 120] * 2048}).encode()
    assert len(body) > openai_api.INLINE_PARSE_BYTES
    seen = []
    real = openai_api.parse_request

    def spy(*a):
        seen.append(threading.current_thread() is threading.main_thread())
        return real(*a)

    openai_api.parse_request = spy
    try:
        big = await openai_api.parse_request_off_loop(EMBEDDINGS, body, 16)
        small = await openai_api.parse_request_off_loop(CHAT, _chat(), 16)
        with pytest.raises(ApiError) as e:
            await openai_api.parse_request_off_loop(EMBEDDINGS, body[:-1] + b', "x": 1}', 16)
    finally:
        openai_api.parse_request = real
    assert seen == [False, True, False]  # big bodies in a worker thread, small ones inline
    assert big.prompt_tokens == 2048 * 120 and small.model == "m"
    assert e.value.status == 400 and e.value.param == "x"
