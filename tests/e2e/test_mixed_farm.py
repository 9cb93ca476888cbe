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
from tests.waiting import wait_for


FOREIGN = "hf-tiny-s1"  # the second dev model, served by `transformers serve` (a foreign worker)
WORKER_KEY_ENV = "LORAFARM_WORKER_KEY_STANDIN"  # only LORAFARM_WORKER_KEY_* may hold a worker's key


class TransformersServe:
    """`transformers serve` (transformers' own OpenAI-compatible server) pinned to a local folder."""

    def __init__(self, folder, port: int, log):
        self.folder, self.port, self.log = folder, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self) -> TransformersServe:
        import os
        import subprocess

        from lorafarm.dev.executables import console_script

        exe = console_script("transformers")
        assert exe is not None, "the transformers CLI is not installed (pip install -e '.[dev]')"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen([exe, "serve", self.folder.name, "--host", "127.0.0.1", "--port",
                                      str(self.port), "--device", "cpu"], cwd=self.folder.parent, env=env,
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self, timeout: float = 180.0) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, open(self.log).read()[-2000:]
            return httpx.get(self.url + "/v1/models", timeout=2).status_code == 200

        wait_for(up, timeout, what="transformers serve answering /v1/models", interval=0.3, logs=self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def lorafarm_cli(info, *args: str) -> str:
    import subprocess
    import sys

    farm = info["_farm"]
    out = subprocess.run([sys.executable, "-m", "lorafarm", *args, "--farm", str(farm.farm_json)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, dev_model, dev_model_b, canaries):
    import os
    import shutil

    from lorafarm.farm import _free_port

    state = tmp_path_factory.mktemp("mixed")
    foreign_dir = state / "foreign" / FOREIGN
    shutil.copytree(dev_model_b, foreign_dir)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    ts = TransformersServe(foreign_dir, _free_port(), state / "logs" / "transformers-serve.log").start()
    os.environ[WORKER_KEY_ENV] = "standin-secret"  # the router (a child process) reads worker keys from its env
    farm = Farm(state, replicas=1, ports=FarmPorts.free(2), progress=False, demo_adapters=1, embeddings=True,
                router_args=["--strategy", "weighted", "--health-failures", "4"])
    shutil.copytree(dev_model, farm.model_dir)
    shutil.copytree(canaries / "c0000", farm.adapters_dir / "c0000")
    try:
        with running(farm) as info:
            ts.wait()
            info["_ts"] = ts
            lorafarm_cli(info, "workers", "add", "ts", "--url", ts.url, "--kind", "openai")
            wait_listed(info, FOREIGN)
            yield info
    finally:
        ts.stop()


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
    # the chat model (or an alias) asked for embeddings, the embedding model asked for chat: the
    # client's mistake, a 400 naming the right endpoint (not a 503 an OpenAI client would retry)
    for model in ("lorafarm-dev-tiny", alias):
        r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding", r.text
        assert r.json()["error"]["param"] == "model" and "embedding model" in r.json()["error"]["message"]
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(mixed["router_url"] + path, headers={"Authorization": f"Bearer {key}"},
                       json={"model": EMBEDDING_MODEL_NAME, "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_chat", r.text
        assert "/v1/embeddings" in r.json()["error"]["message"]


def test_embeddings_unknown_field_is_400_as_on_chat(mixed):
    key = mixed["tenants"][0]["api_key"]
    h = {"Authorization": f"Bearer {key}"}
    r = httpx.post(mixed["router_url"] + "/v1/embeddings", headers=h,
                   json={"model": EMBEDDING_MODEL_NAME, "input": "x", "temperature": 0.2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert r.json()["error"]["code"] == "unsupported_parameter"
    # the worker itself refuses it the same way (straight to its port, with the admin token)
    worker_url = next(r["url"] for r in mixed["replicas"] if r.get("task") == "embed")
    r = httpx.post(worker_url + "/v1/embeddings",
                   headers={"Authorization": f"Bearer {mixed['admin_token']}"},
                   json={"model": EMBEDDING_MODEL_NAME, "input": "x", "temperature": 0.2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


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


# -- foreign workers ------------------------------------------------------------------------------


def _models(info) -> list[dict]:
    key = info["tenants"][0]["api_key"]
    return httpx.get(info["router_url"] + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]


def _health(info) -> dict:
    return httpx.get(info["router_url"] + "/health").json()


def wait_until(pred, timeout: float = 60.0, what: str | None = None):
    return wait_for(pred, timeout, what=what, interval=0.2)


def wait_listed(info, model: str, listed: bool = True) -> None:
    wait_until(lambda: (model in {m["id"] for m in _models(info)}) == listed, what=f"{model} listed={listed}")


def _chat(info, model: str, stream: bool = False) -> httpx.Response:
    key = info["tenants"][0]["api_key"]
    return httpx.post(info["router_url"] + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "stream": stream}, timeout=60)


def test_catalog_is_one_deduplicated_list_naming_no_host(mixed):
    models = _models(mixed)
    ids = [m["id"] for m in models]
    for name in ("lorafarm-dev-tiny", EMBEDDING_MODEL_NAME, FOREIGN):
        assert ids.count(name) == 1, ids
    assert len(ids) == len(set(ids))
    ts_url = mixed["_ts"].url
    for m in models:
        assert "127.0.0.1" not in str(m.get("owned_by")) and ts_url not in str(m)


def test_foreign_chat_streams_through_the_official_client_and_reaches_only_that_worker(mixed, client):
    stream = client.chat.completions.create(model=FOREIGN, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    r = _chat(mixed, FOREIGN)
    assert r.status_code == 200 and r.headers["x-replica-id"] == "worker:ts"
    assert r.json()["choices"][0]["message"]["content"]
    # the lorafarm base still goes to the lorafarm replica, embeddings to the embedding worker
    assert _chat(mixed, "lorafarm-dev-tiny").headers["x-replica-id"] == "r0"


def test_unknown_model_is_404_model_not_found(mixed, client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-worker-lists-this", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


def test_warm_first_then_weights_within_a_class(mixed):
    from tests.e2e.standin import StandIn

    cold = StandIn("cold", {"shared-model": "unloaded", "w-model": "unloaded"}).start()
    warm = StandIn("warm", {"shared-model": "loaded", "w-model": "unloaded"}, api_key="standin-secret").start()
    try:
        lorafarm_cli(mixed, "workers", "add", "cold", "--url", cold.url, "--kind", "openai", "--weight", "8")
        lorafarm_cli(mixed, "workers", "add", "warm", "--url", warm.url, "--kind", "openai",
                     "--api-key-env", WORKER_KEY_ENV, "--weight", "1")
        listed = lorafarm_cli(mixed, "workers", "list")
        assert "standin-secret" not in listed and WORKER_KEY_ENV in listed
        wait_until(lambda: {w["worker"]: w for w in _health(mixed)["workers"]}.get("warm", {}).get("loaded"),
                   what="warm worker polled")
        wait_until(lambda: {w["worker"]: w for w in _health(mixed)["workers"]}.get("cold", {}).get("models"),
                   what="cold worker polled")
        # the worker reporting the model loaded wins although the other is 8x heavier
        for _ in range(4):
            r = _chat(mixed, "shared-model")
            assert r.status_code == 200 and r.headers["x-replica-id"] == "worker:warm"
        assert warm.chats == 4 and cold.chats == 0
        # the secret came from the router's environment; the admin token never left the farm
        assert "Bearer standin-secret" in warm.auth_seen
        assert not any(mixed["admin_token"] in a for a in warm.auth_seen + cold.auth_seen)
        # same class (both installed, not loaded): the weighted strategy favours the bigger box
        for _ in range(4):
            assert _chat(mixed, "w-model").headers["x-replica-id"] == "worker:cold"
        lorafarm_cli(mixed, "workers", "add", "cold", "--url", cold.url, "--kind", "openai", "--weight", "0.1")
        wait_until(lambda: {w["worker"]: w for w in _health(mixed)["workers"]}.get("cold", {}).get("weight") == 0.1,
                   what="new weight applied")
        for _ in range(4):
            assert _chat(mixed, "w-model").headers["x-replica-id"] == "worker:warm"
        # a stand-in answers streamed chat too; the client sees the worker's text
        r = _chat(mixed, "shared-model", stream=True)
        assert "from" in r.text and "warm" in r.text and r.text.rstrip().endswith("[DONE]")
    finally:
        for name in ("cold", "warm"):
            lorafarm_cli(mixed, "workers", "remove", name)
        cold.stop()
        warm.stop()
    wait_listed(mixed, "shared-model", listed=False)


def _lorafarm_cli_fails(info, *args: str) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lorafarm", *args, "--farm", str(info["_farm"].farm_json)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out.stdout
    return out.stderr


def test_worker_key_env_outside_the_prefix_is_refused_and_never_sent(mixed):
    from tests.e2e.standin import StandIn

    spy = StandIn("spy", {"spy-model": "loaded"}).start()
    try:
        for var in ("LORAFARM_ADMIN_TOKEN", "HOME"):
            err = _lorafarm_cli_fails(mixed, "workers", "add", "spy", "--url", spy.url, "--kind", "openai",
                                      "--api-key-env", var)
            assert len(err.strip().splitlines()) == 1 and "LORAFARM_WORKER_KEY_" in err
            # the registry API refuses it too (a 4xx naming the rule), whoever calls it
            r = httpx.put(mixed["registry_url"] + "/internal/workers/spy",
                          headers={"Authorization": f"Bearer {mixed['admin_token']}"},
                          json={"url": spy.url, "kind": "openai", "api_key_env": var})
            assert r.status_code == 400 and "LORAFARM_WORKER_KEY_" in r.json()["error"]["message"]
        assert "spy" not in lorafarm_cli(mixed, "workers", "list")
        assert not spy.auth_seen  # never registered: never polled
    finally:
        spy.stop()


def test_foreign_catalog_adds_base_models_only_and_worker_changes_are_audited(mixed):
    from tests.e2e.standin import StandIn

    tenant = mixed["tenants"][0]
    alias, adapter = sorted(tenant["aliases"].items())[0]
    admin = {"Authorization": f"Bearer {mixed['admin_token']}"}
    r = httpx.post(mixed["registry_url"] + "/internal/tenants", headers=admin, json={"name": "catalog-other"})
    assert r.status_code in (200, 201), r.text
    other_key = r.json()["api_key"]
    names = {"plain-foreign-base": "loaded", alias: "loaded", adapter: "loaded", "other/planted:prod": "loaded",
             "ad-0123456789abcdef0123": "loaded"}
    ev = StandIn("evil", names).start()
    try:
        lorafarm_cli(mixed, "workers", "add", "evil", "--url", ev.url, "--kind", "openai")
        wait_listed(mixed, "plain-foreign-base")
        keys = [tenant["api_key"], other_key]
        for key in keys:
            ids = {m["id"] for m in httpx.get(mixed["router_url"] + "/v1/models",
                                              headers={"Authorization": f"Bearer {key}"}).json()["data"]}
            assert "plain-foreign-base" in ids
            assert not ids & {"other/planted:prod", "ad-0123456789abcdef0123"}
            if key != tenant["api_key"]:
                assert alias not in ids and adapter not in ids
        # the alias still reaches the tenant's adapter on our replica, never the foreign worker
        r = _chat(mixed, alias)
        assert r.status_code == 200 and r.headers["x-replica-id"] == "r0"
        assert ev.chats == 0
        r = _chat(mixed, "other/planted:prod")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        lorafarm_cli(mixed, "workers", "remove", "evil")
        ev.stop()
    lorafarm_cli(mixed, "models", "critical", "plain-foreign-base")
    lorafarm_cli(mixed, "models", "critical", "plain-foreign-base", "--off")
    r = httpx.get(mixed["registry_url"] + "/internal/audit", params={"target": "evil"}, headers=admin)
    assert [a["action"] for a in r.json()][:2] == ["worker.remove", "worker.add"]
    assert r.json()[1]["detail"]["url"] == ev.url
    r = httpx.get(mixed["registry_url"] + "/internal/audit", params={"target": "plain-foreign-base"},
                  headers=admin)
    assert [a["action"] for a in r.json()][:2] == ["model.uncritical", "model.critical"]


def test_ollama_worker_listed_routed_and_its_errors_mapped(mixed):
    from tests.e2e.standin import StandIn

    ol = StandIn("ollama", {"llama3:8b": "loaded", "ghost:latest": None}, refuse=("ghost:latest",)).start()
    try:
        lorafarm_cli(mixed, "workers", "add", "ol", "--url", ol.url, "--kind", "ollama")
        wait_listed(mixed, "ghost:latest")
        w = next(w for w in _health(mixed)["workers"] if w["worker"] == "ol")
        assert w["loaded"] == ["llama3:8b"] and sorted(w["models"]) == ["ghost:latest", "llama3:8b"]
        r = _chat(mixed, "llama3:8b")
        assert r.status_code == 200 and r.headers["x-replica-id"] == "worker:ol"
        # Ollama's own error shape {"error": "text"} reaches the client as an OpenAI error object
        for stream in (False, True):
            r = _chat(mixed, "ghost:latest", stream=stream)
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and "not found" in err["message"] and err["type"]
    finally:
        lorafarm_cli(mixed, "workers", "remove", "ol")
        ol.stop()


def test_critical_model_on_one_worker_is_degraded(mixed):
    lorafarm_cli(mixed, "models", "critical", FOREIGN)
    try:
        h = wait_until(lambda: (h := _health(mixed))["degraded_models"] and h, what="degraded")
        assert h["status"] == "degraded" and h["degraded_models"] == [{"model": FOREIGN, "workers": 1}]
        line = f'lorafarm_router_critical_model_degraded{{model="{FOREIGN}"}} 1.0'
        wait_until(lambda: line in httpx.get(mixed["router_url"] + "/metrics").text, what="metric")  # next poll
        status = lorafarm_cli(mixed, "farm", "status")
        assert "degraded" in status and FOREIGN in status
    finally:
        lorafarm_cli(mixed, "models", "critical", FOREIGN, "--off")
    wait_until(lambda: not _health(mixed)["degraded_models"], what="not degraded")


def test_foreign_worker_stopped_then_restarted(mixed):
    ts = mixed["_ts"]
    ts.stop()
    # possibly warm: its catalog cannot be fetched, it stays listed until its health checks fail
    h = wait_until(lambda: next((w for w in _health(mixed)["workers"] if w["worker"] == "ts"
                                 and not w["catalog_fresh"]), None), what="catalog unavailable")
    if h["healthy"]:
        assert FOREIGN in {m["id"] for m in _models(mixed)}
    wait_until(lambda: any(w["worker"] == "ts" and not w["healthy"] for w in _health(mixed)["workers"]),
               what="health checks failed")
    r = _chat(mixed, FOREIGN)
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable"
    assert FOREIGN not in {m["id"] for m in _models(mixed)}
    ts.start()
    ts.wait()
    wait_listed(mixed, FOREIGN)  # back without a router restart
    r = _chat(mixed, FOREIGN)
    assert r.status_code == 200 and r.headers["x-replica-id"] == "worker:ts"
