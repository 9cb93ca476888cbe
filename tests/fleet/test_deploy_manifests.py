"""deploy/: the kustomize overlays render offline and validate against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail), and the settings agree with the code they drive."""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate as kv
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy"))
from render import render  # noqa: E402

K8S = "1.32.0"
OVERLAYS = ("gpu", "cpu")
CRDS = {"ScaledObject", "ServiceMonitor"}


def _key(d):
    return d["kind"], d["metadata"]["name"]


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request):
    return {_key(d): d for d in render(REPO / "deploy" / "overlays" / request.param)}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: deploy/render.py alone")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy" / "overlays" / overlay)], capture_output=True,
                         text=True, check=True).stdout
    ref = {_key(d): d for d in yaml.safe_load_all(out) if d}
    assert {_key(d): d for d in render(REPO / "deploy" / "overlays" / overlay)} == ref


def test_every_builtin_object_validates_strict(docs):
    kinds = {k for k, _ in docs}
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "PersistentVolumeClaim", "ScaledObject", "ServiceMonitor"} <= kinds
    for (kind, name), d in docs.items():
        if kind not in CRDS:
            kv.validate(d, K8S, strict=True)


def test_strict_validation_can_fail(docs):
    bad = copy.deepcopy(docs[("StatefulSet", "replica")])
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/ready"}}  # typo
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S, strict=True)


def _replica_args(docs) -> list[str]:
    c = docs[("StatefulSet", "replica")]["spec"]["template"]["spec"]["containers"][0]
    return shlex.split(c["args"][0].replace('"$(POD_NAME)"', "replica-0").replace("$(POD_NAME)", "replica-0"))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_replica_statefulset_contract(docs):
    sts = docs[("StatefulSet", "replica")]
    spec = sts["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert sts["spec"]["serviceName"] == "replica" and docs[("Service", "replica")]["spec"]["clusterIP"] == "None"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"] and c["livenessProbe"] and c["lifecycle"]["preStop"]
    assert "/internal/drain" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert spec["affinity"]["podAntiAffinity"]
    args = _replica_args(docs)
    grace = float(_flag(args, "--shutdown-grace-s"))
    longest_stream = 2000 * 0.05  # max request tokens x the seed's decode step
    assert spec["terminationGracePeriodSeconds"] > grace > longest_stream
    assert spec["securityContext"]["runAsNonRoot"] is True
    base = next(v for v in spec["volumes"] if v["name"] == "base")
    assert base["persistentVolumeClaim"]["readOnly"] is True
    assert docs[("PersistentVolumeClaim", "base-model")]["spec"]["accessModes"] == ["ReadOnlyMany"]
    pdb = docs[("PodDisruptionBudget", "replica")]["spec"]
    assert pdb["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"] and pdb["maxUnavailable"] == 1
    # the replica CLI accepts these flags
    from lorafarm.cli import build_parser

    build_parser().parse_args(args[args.index("replica"):])


def test_gpu_replica_fits_an_80gb_gpu_by_the_capacity_calculator():
    from handler.cli import parse_rank_mix, parse_size
    from lorafarm import capacity as cap

    docs = {_key(d): d for d in render(REPO / "deploy" / "overlays" / "gpu")}
    args = _replica_args(docs)
    dims = cap.ModelDims()  # the 7B shapes of the seed, bf16
    pools = cap.slots_for_budget(parse_size(_flag(args, "--lora-memory-bytes")),
                                 parse_rank_mix(_flag(args, "--rank-mix")), dims)
    assert pools == {16: 250}
    kv_bytes = parse_size(_flag(args, "--kv-cache-bytes"))
    assert kv_bytes >= cap.kv_bytes_per_token(dims) * int(_flag(args, "--max-batch")) * 2000
    total = cap.replica_memory_bytes(dims, pools, kv_cache_bytes=kv_bytes, working_gb=cap.GpuSpec().working_gb)
    assert total <= 80e9, f"{total / 1e9:.1f} GB"
    c = docs[("StatefulSet", "replica")]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert docs[("StatefulSet", "replica")]["spec"]["replicas"] == cap.compute().replicas


def test_autoscaler_reads_metrics_the_replica_exports(docs):
    from handler.serving.metrics import ReplicaMetrics

    so = docs[("ScaledObject", "replica")]["spec"]
    assert so["scaleTargetRef"]["kind"] == "StatefulSet" and so["scaleTargetRef"]["name"] == "replica"
    behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    from loadtests.simulate import AutoscaleConfig

    a = AutoscaleConfig()  # the simulator models this same rule
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == a.scale_down_window_s
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == a.scale_up_window_s
    assert so["pollingInterval"] == a.sync_s
    thresholds = {}
    exported = ReplicaMetrics("r0", "m").render().decode()
    for t in so["triggers"]:
        assert t["type"] == "prometheus" and t["metricType"] == "AverageValue"
        name = re.search(r"(lorafarm_[a-z_]+)", t["metadata"]["query"]).group(1)
        assert f"# TYPE {name} gauge" in exported, name
        thresholds[name] = float(t["metadata"]["threshold"])
    assert thresholds == {"lorafarm_num_requests_waiting": a.target_queue_depth,
                          "lorafarm_tokens_in_flight": a.target_tokens_in_flight}


def test_router_args_parse_and_use_the_simulated_threshold(docs):
    from loadtests.simulate import SimConfig
    from lorafarm.cli import build_parser

    args = docs[("Deployment", "router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    ns = build_parser().parse_args(args)
    assert ns.load_threshold_tokens == SimConfig().load_threshold_tokens


def test_servicemonitor_selects_services_with_an_http_port(docs):
    sm = docs[("ServiceMonitor", "lorafarm")]["spec"]
    apps = set(sm["selector"]["matchExpressions"][0]["values"])
    port = sm["endpoints"][0]["port"]
    for app in apps:
        svc = docs[("Service", app)]
        assert svc["metadata"]["labels"]["app"] == app
        assert port in {p["name"] for p in svc["spec"]["ports"]}


def test_dockerfile_installs_every_package_with_pinned_torch_as_non_root():
    import tomllib

    text = (REPO / "deploy" / "Dockerfile").read_text()
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in packages:
        assert f"COPY {pkg.rstrip('*')} " in text, pkg
    torch_pin = re.search(r"TORCH_VERSION \?= ([0-9.]+)", (REPO / "Makefile").read_text()).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in text
    assert re.search(r"^USER 10001$", text, re.M) and "VARIANT=cpu" in text and "cuda)" in text
