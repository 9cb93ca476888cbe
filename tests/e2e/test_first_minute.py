"""Issue 37, "ready means answering": `lorafarm up` prints its ready message (and writes farm.json) only
once a chat through the router has been answered, so a client that chats the moment it reads the message
gets answers, never a 503; and while replicas are still starting the router says so (503 naming them,
with Retry-After), never "No replica could serve the request".

The first test runs the real `lorafarm up --dev` command as a child process (registry, router and two
replicas of its own) with the official openai client; the state dir is seeded with the cached dev model
and canaries so nothing is trained. The second runs the real router against the suite's stand-in
registry that lists a replica which has not started yet.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from lorafarm.farm import BASE_MODEL_NAME, FarmPorts, _free_port
from tests.conftest import CANARY_DIR, make_canaries
from tests.waiting import wait_for

READY_LINE = "lorafarm is up."
CANARIES = 4  # what `lorafarm up --dev` seeds (lorafarm.farm.DEMO_ADAPTERS)


@pytest.fixture
def up_process(tmp_path, dev_model):
    """`lorafarm up --dev --replicas 2` on free ports; yields (process, state dir, lines printed so far,
    an event set when the ready line is printed)."""
    make_canaries(dev_model, CANARIES)
    state = tmp_path / "state"
    shutil.copytree(dev_model, state / "models" / BASE_MODEL_NAME)
    for i in range(CANARIES):
        shutil.copytree(CANARY_DIR / f"c{i:04d}", state / "demo-adapters" / f"c{i:04d}")
    ports = FarmPorts.free(2)
    cmd = [sys.executable, "-m", "lorafarm", "up", "--dev", "--replicas", "2", "--state-dir", str(state),
           "--port", str(ports.router), "--registry-port", str(ports.registry),
           "--replica-port", str(ports.replica_base)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if READY_LINE in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield proc, state, lines, ready
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)


def test_ready_message_means_a_chat_is_answered(up_process):
    proc, state, lines, ready = up_process
    wait_for(lambda: ready.is_set() or proc.poll() is not None, timeout=600, what="the ready message",
             logs=[state / "logs"])
    assert ready.is_set(), "".join(lines)[-3000:]
    # at once, with no retries: the base and every demo alias answer through the router
    farm = json.loads((state / "farm.json").read_text())  # written before the message
    tenant = farm["tenants"][0]
    client = openai.OpenAI(base_url=farm["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0,
                           timeout=120)
    for model in [BASE_MODEL_NAME, *sorted(tenant["aliases"])]:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=8, temperature=0)
        assert r.choices[0].message.content is not None
        if model in farm["markers"]:
            assert r.choices[0].message.content == farm["markers"][model]
    text = "".join(lines)
    assert '"temperature": 0' in text  # the printed snippets promise greedy answers only with temperature 0


async def test_router_names_replicas_still_starting():
    """A replica the registry lists but that does not listen yet: 503 with Retry-After naming it."""
    from tests.router.conftest import router_farm

    async with router_farm(replicas=()) as farm:
        key = farm.registry.add_tenant("acme")
        farm.registry.add_adapter("acme", "support", "dev-a", alias="acme/support:prod")
        farm.registry.add_replica("r7", f"http://127.0.0.1:{_free_port()}", "dev-a")  # nothing listens there
        await farm.sync()
        client = farm.client(key)
        for model in ["acme/support:prod", "dev-a"]:
            with pytest.raises(openai.APIStatusError) as exc:
                await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            assert exc.value.status_code == 503, exc.value
            assert exc.value.code == "replicas_starting" and "r7" in exc.value.message
            assert "No replica could serve" not in exc.value.message
            assert exc.value.response.headers["retry-after"] == "2"
        async with httpx.AsyncClient() as http:  # the router itself is up
            assert (await http.get(farm.url + "/health")).status_code in (200, 503)
