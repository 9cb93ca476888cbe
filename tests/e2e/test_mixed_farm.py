"""A mixed farm through real processes: one lorafarm chat replica, one embedding worker
(`lorafarm replica --task embed`) and, for the foreign-worker tests, a real `transformers serve`
process, all behind one router and one API key."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from openai import OpenAI

from lorafarm.farm import EMBEDDING_MODEL_NAME, Farm, FarmPorts
from tests.e2e.conftest import running


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, dev_model, canaries):
    import shutil

    state = tmp_path_factory.mktemp("mixed")
    farm = Farm(state, replicas=1, ports=FarmPorts.free(2), progress=False, demo_adapters=1, embeddings=True)
    shutil.copytree(dev_model, farm.model_dir)
    shutil.copytree(canaries / "c0000", farm.adapters_dir / "c0000")
    with running(farm) as info:
        yield info


@pytest.fixture(scope="module")
def client(mixed):
    return OpenAI(base_url=mixed["router_url"] + "/v1", api_key=mixed["tenants"][0]["api_key"], max_retries=0)


@pytest.fixture(scope="module")
def st_model(mixed):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(mixed["embedding_models"][EMBEDDING_MODEL_NAME], device="cpu")


TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "how do I reset my password?"]


def test_embeddings_equal_sentence_transformers(client, st_model, mixed):
    r = client.embeddings.create(model=EMBEDDING_MODEL_NAME, input=TEXTS)
    got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    want = st_model.encode(TEXTS, convert_to_numpy=True)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    assert r.model == EMBEDDING_MODEL_NAME
    # one string, base64, and Matryoshka dimensions
    raw = httpx.post(mixed["router_url"] + "/v1/embeddings",
                     headers={"Authorization": f"Bearer {mixed['tenants'][0]['api_key']}"},
                     json={"model": EMBEDDING_MODEL_NAME, "input": TEXTS[1], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(vec - want[1]).max() <= 1e-5
    small = client.embeddings.create(model=EMBEDDING_MODEL_NAME, input=TEXTS, dimensions=16)
    want16 = st_model.encode(TEXTS, convert_to_numpy=True, truncate_dim=16, normalize_embeddings=True)
    assert np.abs(np.array([d.embedding for d in small.data]) - want16).max() <= 1e-5


def test_embeddings_reach_only_the_embedding_worker(mixed):
    key = mixed["tenants"][0]["api_key"]
    r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                   json={"model": EMBEDDING_MODEL_NAME, "input": "x"})
    assert r.status_code == 200 and r.headers["x-replica-id"] == "e0"
    alias = sorted(mixed["tenants"][0]["aliases"])[0]
    r = httpx.post(mixed["router_url"] + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-replica-id"] == "r0"
    # the chat model asked for embeddings: no embedding worker serves it
    r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "lorafarm-dev-tiny", "input": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable"


def test_concurrent_embeddings_are_batched_and_correct(mixed, st_model):
    import concurrent.futures as cf

    key = mixed["tenants"][0]["api_key"]
    texts = [f"request number {i} " * (1 + i % 5) for i in range(24)]

    def one(t):
        return httpx.post(mixed["router_url"] + "/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                          json={"model": EMBEDDING_MODEL_NAME, "input": t}, timeout=60).json()

    with cf.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, texts))
    got = np.array([o["data"][0]["embedding"] for o in outs])
    assert np.abs(got - st_model.encode(texts, convert_to_numpy=True)).max() <= 1e-5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": ["a"] * 10_000}, "input"),
        ({"input": "word " * 400}, "input"),  # over the encoder's 128-token context
        ({"input": 42}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1, 2], "a"]}, "input"),
        ({"input": [[99999]]}, "input"),  # a token id outside the vocabulary
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 4096}, "dimensions"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({}, "input"),
    ],
)
def test_embeddings_bad_input_is_400(mixed, body, param):
    key = mixed["tenants"][0]["api_key"]
    r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                   json={"model": EMBEDDING_MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_embeddings_unknown_model_and_bad_json(mixed):
    key = mixed["tenants"][0]["api_key"]
    h = {"Authorization": f"Bearer {key}"}
    r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers=h, json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers=h, content=b"{not json")
    assert r.status_code == 400
    r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers=h, json={"input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_models_lists_chat_and_embedding_models_once(client):
    ids = [m.id for m in client.models.list().data]
    assert ids.count(EMBEDDING_MODEL_NAME) == 1 and ids.count("lorafarm-dev-tiny") == 1
