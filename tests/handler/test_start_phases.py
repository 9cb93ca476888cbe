"""A replica's start by phase (handler/serving/startup.py) in /metrics and the log, and where its
compile caches live (handler/model/compile_cache.py)."""

from __future__ import annotations

import logging

import httpx

from handler.model import compile_cache
from tests.handler.conftest_service import ReplicaServer


def test_start_phases_in_metrics_and_log(dev_model, tmp_path):
    from handler.serving.config import REPLICA_ENGINE, Limits, ReplicaConfig

    cfg = ReplicaConfig(base_dir=dev_model, replica_id="rs", model_name="dev-tiny", disk_dir=tmp_path / "disk",
                        engine=REPLICA_ENGINE.replace(kv_cache_bytes=8 * 1024 * 1024, device="cpu"),
                        limits=Limits(default_max_tokens=8))
    records: list[logging.LogRecord] = []
    seen = logging.Handler(logging.INFO)
    seen.emit = records.append  # the replica's logger, whatever the logging setup propagates
    logger = logging.getLogger("lorafarm.replica")
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    try:
        with ReplicaServer(cfg) as srv:
            text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    phases = {line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("lorafarm_replica_start_seconds{")}
    assert set(phases) == {"kernels", "weights", "warm-up"}, phases  # in-process: no interpreter start to report
    assert all(s >= 0 for s in phases.values()) and phases["weights"] > 0
    logged = [r.getMessage() for r in records if r.getMessage().startswith("started in")]
    assert logged and all(p in logged[0] for p in phases)


def test_compile_caches_under_one_root_keyed_by_torch_and_cpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv(compile_cache.KERNEL_ENV, str(tmp_path / "elsewhere"))
    monkeypatch.delenv(compile_cache.INDUCTOR_ENV, raising=False)
    monkeypatch.delenv("LORAFARM_CACHE_DIR", raising=False)
    dirs = compile_cache.use()  # no --cache-dir: the environment's own setting wins
    assert dirs["kernels"] == str(tmp_path / "elsewhere")
    assert torch.__version__.replace("+", "_") in dirs["inductor"]
    assert torch.backends.cpu.get_cpu_capability() in dirs["inductor"]
    dirs = compile_cache.use(tmp_path / "farm")  # --cache-dir: every cache under it
    assert dirs["kernels"] == str(tmp_path / "farm" / "kernels")
    assert dirs["inductor"].startswith(str(tmp_path / "farm" / "inductor" / "torch-"))
