"""Least privilege per container in the compose farm (issue 37: one env_file gave every service every
secret). deploy/compose_env.sh runs for real in a copy of deploy/ (it writes compose.env with random
secrets, then one env file per secret); each service's environment is then resolved as compose
resolves it (its env_file list, then `environment`, anchors merged by the YAML loader) and the test
asserts who sees what."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose.yaml"

DATABASE_URL, ADMIN_TOKEN = "LORAFARM_DATABASE_URL", "LORAFARM_ADMIN_TOKEN"
PG_PASSWORD, S3_SECRET = "POSTGRES_PASSWORD", "AWS_SECRET_ACCESS_KEY"
# who may see each secret: the services that use it
ALLOWED = {
    DATABASE_URL: {"registry"},
    PG_PASSWORD: {"postgres"},
    ADMIN_TOKEN: {"registry", "router", "replica-0", "replica-1", "embed-0", "seed", "tools"},
    S3_SECRET: {"init", "registry", "replica-0", "replica-1"},
}


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            out[name] = value
    return out


def service_env(deploy: Path, svc: dict) -> dict[str, str]:
    files = svc.get("env_file") or []
    env: dict[str, str] = {}
    for f in [files] if isinstance(files, str) else files:
        env.update(env_file(deploy / f))
    env.update({k: str(v) for k, v in (svc.get("environment") or {}).items()})
    return env


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("deploy")
    for name in ("compose.yaml", "compose.env.example", "compose_env.sh"):
        shutil.copy(REPO / "deploy" / name, d / name)
    subprocess.run(["sh", str(d / "compose_env.sh")], check=True, capture_output=True, timeout=60)
    return d


def test_each_service_sees_only_the_secrets_it_uses(deploy_copy):
    services = yaml.safe_load((deploy_copy / "compose.yaml").read_text())["services"]
    secrets = env_file(deploy_copy / "compose.env")
    seen = {name: service_env(deploy_copy, svc) for name, svc in services.items()}
    for var, allowed in ALLOWED.items():
        value = secrets[var]
        assert len(value) >= 32 and value != "CHANGE_ME"  # compose_env.sh made it
        holders = {name for name, env in seen.items() if var in env}
        assert holders == allowed, var
        assert all(seen[name][var] == value for name in holders)  # the one value of compose.env
        # the value itself under any other name (the password is inside the database URL too)
        leaks = {name for name, env in seen.items() if any(value in v for v in env.values())}
        assert leaks <= allowed | ({"registry"} if var == PG_PASSWORD else set()), (var, leaks - allowed)
    assert not seen["s3"] and not any(k in seen["prometheus"] for k in secrets)
    # nothing reads the whole file any more
    assert all("compose.env" not in (svc.get("env_file") or []) for svc in services.values())


def test_the_split_files_are_private_and_a_stray_secret_is_refused(deploy_copy):
    for f in deploy_copy.glob("compose.*.env"):
        assert f.stat().st_mode & 0o077 == 0, f
    # a variable of no group would reach no service, or every one: the split refuses it, in one line
    env = deploy_copy / "compose.env"
    original = env.read_text()
    try:
        env.write_text(original + "LORAFARM_REDIS_URL=redis://:secret@redis:6379\n")
        r = subprocess.run(["sh", str(deploy_copy / "compose_env.sh")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "LORAFARM_REDIS_URL" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert "redis" not in "".join(f.read_text() for f in deploy_copy.glob("compose.*.env"))
    finally:
        env.write_text(original)


def test_the_resolution_sees_a_secret_handed_out(deploy_copy):
    """The check above can fail: an env_file giving the router the database URL (as the shared
    compose.env did before issue 37) makes the router a holder."""
    services = yaml.safe_load((deploy_copy / "compose.yaml").read_text())["services"]
    router = {**services["router"], "env_file": [*services["router"]["env_file"], "compose.database.env"]}
    assert DATABASE_URL not in service_env(deploy_copy, services["router"])
    assert DATABASE_URL in service_env(deploy_copy, router)


# -- the Kubernetes manifests: the same rule over the rendered overlays ------------------------------
K8S_ALLOWED = {
    DATABASE_URL: {"registry"},
    ADMIN_TOKEN: {"registry", "router", "replica"},
    S3_SECRET: {"registry", "replica"},
    "LORAFARM_REDIS_URL": {"router"},
}


def k8s_secret_vars(container: dict, secret_keys: dict[str, set[str]]) -> set[str]:
    """The Secret keys a container's environment holds: envFrom secretRef (every key), env secretKeyRef."""
    seen = set()
    for src in container.get("envFrom") or []:
        if "secretRef" in src:
            seen |= secret_keys[src["secretRef"]["name"]]
    for var in container.get("env") or []:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            assert ref["key"] in secret_keys[ref["name"]], ref  # a key the example Secret has
            seen.add(var["name"])
    return seen


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_k8s_workloads_see_only_the_secrets_they_use(overlay):
    import sys

    sys.path.insert(0, str(REPO / "deploy"))
    try:
        from render import render
    finally:
        sys.path.pop(0)
    secrets = {d["metadata"]["name"]: set(d.get("stringData", {}))
               for d in yaml.safe_load_all((REPO / "deploy" / "secrets.example.yaml").read_text()) if d}
    seen = {}
    for d in render(REPO / "deploy" / "overlays" / overlay):
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                seen[d["metadata"]["name"]] = k8s_secret_vars(c, secrets)
    assert set(seen) == {"registry", "router", "replica"}
    for var, allowed in K8S_ALLOWED.items():
        assert {name for name, keys in seen.items() if var in keys} == allowed, var
