"""`lorafarm up --base NAME=DIR --adapters DIR` on a checkpoint written the way Hugging Face
publishes real ones (bf16, sharded safetensors with an index json, saved by transformers), with a
PEFT adapter; and the checks `lorafarm up` makes before it starts anything: ports in use (named
with their holder), unsupported architectures, adapters trained on another base."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from lorafarm.farm import FarmPorts
from tests.e2e.conftest import read_until


@pytest.fixture(scope="module")
def sharded_bf16(dev_model, tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("hf") / "tiny-bf16"
    model = AutoModelForCausalLM.from_pretrained(dev_model, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="500KB")
    AutoTokenizer.from_pretrained(dev_model).save_pretrained(out)
    return out


def _up(args: list[str], **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LORAFARM_ADMIN_TOKEN"}
    return subprocess.Popen([sys.executable, "-m", "lorafarm", "up", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _refused(args: list[str]) -> str:
    proc = _up(args)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-3000:]
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("lorafarm")]
    assert "Traceback" not in out
    return lines[-1]


def _ports_args(ports: FarmPorts) -> list[str]:
    return ["--port", str(ports.router), "--registry-port", str(ports.registry),
            "--replica-port", str(ports.replica_base)]


def test_checks_before_starting(tmp_path, sharded_bf16, canaries):
    ports = FarmPorts.free(1)
    state = tmp_path / "state"
    # A port in use: named, with its holder (this test process), and nothing started or written.
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.registry))
        held.listen()
        line = _refused(["--dev", "--replicas", "1", "--state-dir", str(state), *_ports_args(ports)])
    assert f"registry port {ports.registry} is in use by" in line and f"(pid {os.getpid()})" in line
    assert not state.exists()
    # An architecture the runner does not have.
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    line = _refused(["--base", str(gpt2), "--state-dir", str(state), *_ports_args(ports)])
    assert "GPT2LMHeadModel (model_type 'gpt2') is not supported" in line and "Llama, Mistral, Qwen2" in line
    # The canary records the float32 dev model as its base: not this bf16 checkpoint.
    adapter = tmp_path / "support"
    shutil.copytree(canaries / "c0005", adapter)
    line = _refused(["--base", f"tiny={sharded_bf16}", "--adapters", str(adapter), "--replicas", "1",
                     "--state-dir", str(state), *_ports_args(ports)])
    assert "trained on base sha256:" in line and "none of the --base folders" in line
    (adapter / "base_model_hash.txt").unlink()
    line = _refused(["--base", f"tiny={sharded_bf16}", "--adapters", str(adapter), "--replicas", "1",
                     "--state-dir", str(state), *_ports_args(ports)])
    assert "does not say which base it was trained on" in line


def test_up_with_a_sharded_bf16_checkpoint_and_a_peft_adapter(tmp_path, sharded_bf16, canaries):
    assert len(list(sharded_bf16.glob("model-*-of-*.safetensors"))) > 1
    assert (sharded_bf16 / "model.safetensors.index.json").is_file()
    cfg = json.loads((sharded_bf16 / "config.json").read_text())
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
    adapters = tmp_path / "adapters"
    shutil.copytree(canaries / "c0006", adapters / "support")
    from lorafarm.cli import main

    # the training job records the base it was trained on (here: this checkpoint)
    assert main(["archive", "basehash", str(sharded_bf16), "--write", str(adapters / "support")]) == 0
    ports = FarmPorts.free(1)
    proc = _up(["--base", f"tiny-bf16={sharded_bf16}", "--adapters", str(adapters), "--replicas", "1",
                "--state-dir", str(tmp_path / "state"), *_ports_args(ports)])
    try:
        banner = read_until(proc, "Ctrl-C stops the farm", 300, logs=tmp_path / "state" / "logs")
        assert "Ctrl-C stops the farm" in banner, banner[-3000:]
        info = json.loads((tmp_path / "state" / "farm.json").read_text())
        assert info["base_models"] == {"tiny-bf16": str(sharded_bf16.resolve())}
        tenant = info["tenants"][0]
        assert list(tenant["aliases"]) == ["demo/support:prod"]
        client = OpenAI(base_url=info["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="demo/support:prod", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        reply = raw.parse()
        assert raw.headers["x-adapter-id"] == tenant["aliases"]["demo/support:prod"]
        assert reply.model == "demo/support:prod" and reply.usage.completion_tokens > 0
        models = {m.id: m.model_dump() for m in client.models.list()}
        assert models["demo/support:prod"]["parent"] == "tiny-bf16" and "tiny-bf16" in models
        base_reply = client.chat.completions.create(model="tiny-bf16", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4)
        assert base_reply.model == "tiny-bf16"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
