"""Embedding fairness (issue 21, item 6) with a real embedding worker process (`lorafarm replica
--task embed` on the dev encoder): one tenant's 2,048 inputs x 120 tokens in flight, another tenant's
1-input request is answered while the big one is still running (first-in-first-out answered it only
after all 2,048). The check is on order, not on time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from tests.handler.conftest_service import wait_healthy
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from lorafarm.dev.embedding import write_dev_embedding_model
    from lorafarm.farm import _free_port

    tmp = tmp_path_factory.mktemp("embed-fair")
    folder = write_dev_embedding_model(tmp / "enc", size="tiny")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "worker.log"
    proc = subprocess.Popen([sys.executable, "-m", "lorafarm", "replica", "--task", "embed", "--id", "e9",
                             "--host", "127.0.0.1", "--port", str(port), "--base", str(folder), "--model-name", "enc"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ},
                            start_new_session=True)
    try:
        wait_healthy(proc, url, lambda: log.read_text()[-3000:], timeout=180, what="the embedding worker")
        yield {"url": url, "folder": folder, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert "Traceback" not in log.read_text(errors="replace")


def _embed(url: str, tenant: str, inputs, timeout: float = 300) -> dict:
    r = httpx.post(url + "/v1/embeddings", headers={"x-lorafarm-tenant": tenant},
                   json={"model": "enc", "input": inputs}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def test_small_request_is_answered_while_a_huge_one_of_another_tenant_runs(worker):
    url = worker["url"]
    rng = np.random.default_rng(0)
    huge_inputs = rng.integers(10, 450, size=(2048, 120)).tolist()
    huge: dict = {}

    def attack():
        huge["answer"] = _embed(url, "attacker", huge_inputs)

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    # wait until the big request is in the worker's batcher (its state counts it as running)
    def in_batcher() -> bool:
        if httpx.get(url + "/internal/replicas/e9/state", timeout=10).json()["running"] >= 1:
            return True
        assert t.is_alive(), "the big request ended before it was seen in the batcher"
        return False

    wait_for(in_batcher, 120, interval=0.005, what="the big request in the batcher", logs=worker["log"])
    small = _embed(url, "victim", "a small question")
    assert "answer" not in huge, "the small request waited for all 2,048 inputs"
    state = httpx.get(url + "/internal/replicas/e9/state", timeout=10).json()
    assert state["running"] >= 1  # the big one is still being embedded
    t.join(timeout=300)
    assert len(huge["answer"]["data"]) == 2048 and huge["answer"]["usage"]["prompt_tokens"] == 2048 * 120
    # chunks of the big request came back in order and equal the vectors computed on their own
    some = [0, 777, 2047]
    alone = _embed(url, "attacker", [huge_inputs[i] for i in some])
    got = np.array([huge["answer"]["data"][i]["embedding"] for i in some])
    assert np.abs(got - np.array([d["embedding"] for d in alone["data"]])).max() <= 1e-5
    assert len(small["data"]) == 1


def test_unknown_field_is_400_at_the_worker(worker):
    r = httpx.post(worker["url"] + "/v1/embeddings", json={"model": "enc", "input": "x", "top_p": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    assert r.json()["error"]["code"] == "unsupported_parameter"
