"""Issue 21, grammar half, on a real replica process (`lorafarm replica` on 127.0.0.1, its grammar
workers real processes): poison schemas fail only their own request with a 400 and the replica keeps
serving; parser-limit schemas never answer 200 with a broken document; a huge schema compiling does
not stop another tenant's stream; distinct large schemas keep the replica's RSS bounded.

No timing assertions: the checks wait on events (tokens received, responses finished)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from handler.grammar.pool import FAULT_ENV, FAULT_TITLE
from tests.handler.conftest_service import free_port, wait_healthy
from tests.handler.test_grammar_pool import RECURSIVE_REQUIRED, many_properties, ref_chain

REPO = Path(__file__).resolve().parents[2]
CACHE_BYTES = 16 * 1024**2


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Replica:
    def __init__(self, dev_model: Path, tmp: Path, flags: tuple[str, ...] = (
            "--grammar-timeout-s", "60", "--grammar-cache-bytes", str(CACHE_BYTES))):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logfile = tmp / "replica.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAFARM_ADMIN_TOKEN": "", FAULT_ENV: "segv"}
        env.pop("LORAFARM_REGISTRY_URL", None)
        self._log = open(self.logfile, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorafarm", "replica", "--id", "g0", "--base", str(dev_model),
             "--port", str(self.port), "--model-name", "dev-tiny", "--disk-dir", str(tmp / "disk"),
             "--kv-cache-bytes", "16MiB", "--slots", "1", "--prefetch-interval-s", "0", "--log-level", "warning",
             *flags],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.url, self.log, timeout=180)

    def log(self) -> str:
        return self.logfile.read_text(errors="replace")[-4000:]

    def chat(self, tenant: str = "t-a", timeout: float = 120, **body) -> httpx.Response:
        body = {"model": "dev-tiny", "messages": [{"role": "user", "content": "a user record"}],
                "max_tokens": 24, "temperature": 0, **body}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout,
                          headers={"x-lorafarm-tenant": tenant})

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="module")
def replica(dev_model, tmp_path_factory):
    r = Replica(dev_model, tmp_path_factory.mktemp("grammar-replica"))
    yield r
    r.stop()


def schema_format(schema: dict, name: str = "s") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def assert_serving(replica: Replica) -> None:
    assert replica.proc.poll() is None, replica.log()
    assert httpx.get(f"{replica.url}/health", timeout=10).status_code == 200
    r = replica.chat(response_format=schema_format({"type": "object", "properties": {"n": {"type": "integer"}},
                                                    "required": ["n"]}), max_tokens=40)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    if ch["finish_reason"] == "stop":
        assert isinstance(json.loads(ch["message"]["content"])["n"], int)


def stream_chat(replica: Replica, **body) -> tuple[int, list[dict]]:
    """(status, SSE events) of a streamed chat request."""
    events = []
    body = {"model": "dev-tiny", "messages": [{"role": "user", "content": "a user record"}], "max_tokens": 24,
            "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{replica.url}/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return 200, events


def test_poison_schemas_fail_only_their_own_request(replica):
    assert_serving(replica)
    for schema in (ref_chain(1000), {"title": FAULT_TITLE, "type": "object"}):  # SIGSEGV in a worker
        r = replica.chat(response_format=schema_format(schema))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_schema" and "SIGSEGV" in err["message"], err
        assert_serving(replica)
    # a poison schema again: refused from memory, no worker is lost to it twice
    r = replica.chat(response_format=schema_format(ref_chain(1000)))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_schema"
    # a tool's parameters crash their worker the same way (the chain itself would not fit the dev
    # model's context once the tool prompt shows it: the test fault stands in for it)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"title": FAULT_TITLE, "type": "object"}}}
    r = replica.chat(tools=[tool], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_schema", r.text
    assert "SIGSEGV" in r.json()["error"]["message"] and r.json()["error"]["param"] == "tools"
    assert_serving(replica)
    assert "Traceback" not in replica.log()
    # the workers lost are counted where an operator looks: crashes and respawns in /metrics
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    crashes = [ln for ln in text.splitlines() if ln.startswith('lorafarm_grammar_compile_failures_total{limit="crash"}')]
    assert crashes and float(crashes[0].split()[-1]) >= 3, crashes
    respawns = [ln for ln in text.splitlines() if ln.startswith("lorafarm_grammar_worker_respawns_total ")]
    assert respawns and float(respawns[0].split()[-1]) >= 3, respawns


@pytest.mark.parametrize("schema", [many_properties(1000), RECURSIVE_REQUIRED], ids=["1000-props", "recursive"])
def test_parser_limit_schemas_never_answer_200_with_invalid_json(replica, schema):
    r = replica.chat(response_format=schema_format(schema), n=4, temperature=1.0, max_tokens=64)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_schema" and "limit" in r.json()["error"]["message"]
    status, events = stream_chat(replica, response_format=schema_format(schema), n=4, temperature=1.0)
    assert status == 400 and events[0]["error"]["code"] == "invalid_schema"


def test_a_cut_off_tool_call_is_not_content(replica):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    # max_tokens too small for even one call: the call is cut off
    r = replica.chat(tools=[tool], tool_choice="required", max_tokens=6, temperature=1.0, seed=1, n=3)
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "length"
        assert ch["message"]["content"] in (None, ""), ch
    status, events = stream_chat(replica, tools=[tool], tool_choice="required", max_tokens=6, temperature=1.0,
                                 seed=1, n=3)
    assert status == 200
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == "" and any(e["choices"][0].get("finish_reason") == "length" for e in events if e.get("choices"))


def test_a_huge_schema_compiles_while_another_tenant_streams(replica):
    """A 10,000-property schema (~350 KB) compiles in a worker process and its matcher is built off
    the event loop: another tenant's streams keep producing tokens meanwhile."""
    assert_serving(replica)
    compiling = threading.Event()
    compiled = threading.Event()
    during: list[float] = []  # token arrival times of the other tenant while the compile is in flight
    result: dict = {}

    def other_tenant():
        body = {"model": "dev-tiny", "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": 32, "temperature": 1.0, "ignore_eos": True, "stream": True}
        while not compiled.is_set():
            with httpx.stream("POST", f"{replica.url}/v1/chat/completions", json=body, timeout=120,
                              headers={"x-lorafarm-tenant": "t-b"}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {") and compiling.is_set() and not compiled.is_set():
                        during.append(time.monotonic())

    def attacker():
        compiling.set()
        try:
            result["r"] = replica.chat(tenant="t-a", response_format=schema_format(many_properties(10000, True)),
                                       max_tokens=8, timeout=300)
        finally:
            compiled.set()

    t = threading.Thread(target=other_tenant, daemon=True)
    t.start()
    a = threading.Thread(target=attacker, daemon=True)
    a.start()
    a.join(300)
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "length" and ch["message"]["content"].startswith('{"p0": ')
    # the other tenant kept streaming while the schema compiled (the old replica froze: no token at all)
    assert len(during) >= 10, len(during)
    assert_serving(replica)


def test_distinct_large_schemas_keep_rss_bounded(replica):
    """200 distinct ~40 KB enum schemas: the grammar cache keeps at most --grammar-cache-bytes of
    them (a tenant 1/4 of it), so RSS stays within the cache bound plus allocator slack."""
    def enum_schema(k: int) -> dict:
        return {"type": "object", "properties": {"v": {"enum": [f"value-{k}-{i:05d}" for i in range(2000)]}},
                "required": ["v"]}

    for k in range(5):  # warm: allocator arenas, first compiles
        assert replica.chat(tenant="t-warm", response_format=schema_format(enum_schema(-k - 1)),
                            max_tokens=4).status_code == 200
    before = rss_bytes(replica.proc.pid)
    done = 0

    def client(ks):
        nonlocal done
        with httpx.Client(timeout=120) as c:
            for k in ks:
                body = {"model": "dev-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                        "response_format": schema_format(enum_schema(k))}
                r = c.post(f"{replica.url}/v1/chat/completions", json=body,
                           headers={"x-lorafarm-tenant": f"t{k % 4}"})
                assert r.status_code == 200, r.text
                done += 1

    threads = [threading.Thread(target=client, args=(range(i, 200, 2),)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert done == 200
    after = rss_bytes(replica.proc.pid)
    growth = after - before
    print(f"replica RSS {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB after 200 distinct schemas")
    assert growth < CACHE_BYTES + 64 * 1024**2, (before, after)
    assert_serving(replica)


def test_a_huge_prompt_is_tokenized_off_the_event_loop(replica):
    """Fairness beyond grammars: a ~900 KB prompt is parsed and rendered on a prep thread and refused
    as past the context by its byte bound, not tokenized whole (seconds of CPU before issue 35);
    another tenant's stream runs meanwhile."""
    busy, done = threading.Event(), threading.Event()
    during: list[float] = []
    result: dict = {}

    def other_tenant():
        body = {"model": "dev-tiny", "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": 32, "temperature": 1.0, "ignore_eos": True, "stream": True}
        while not done.is_set():
            with httpx.stream("POST", f"{replica.url}/v1/chat/completions", json=body, timeout=120,
                              headers={"x-lorafarm-tenant": "t-b"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and busy.is_set() and not done.is_set():
                        during.append(time.monotonic())

    def big_prompt():
        busy.set()
        try:
            result["r"] = replica.chat(tenant="t-a", messages=[{"role": "user", "content": "lorem ipsum " * 75000}])
        finally:
            done.set()

    t = threading.Thread(target=other_tenant, daemon=True)
    t.start()
    a = threading.Thread(target=big_prompt, daemon=True)
    a.start()
    a.join(300)
    t.join(120)
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "context_length_exceeded"
    # issue 35: refused by its byte bound before it is tokenized whole (a tenth of a second, so the
    # other tenant's tokens meanwhile are no longer a count to assert: test_fair_replica.py shows
    # another tenant served while a prep thread is held)
    assert "at least" in result["r"].json()["error"]["message"]
    assert_serving(replica)
