"""deploy/build_image.sh stops every loopback pip server it starts (issue 37: `serve_dir` ran them in
`$(...)`, the exit trap never learnt their pids, and each build left them running).

The whole script runs for real; only docker is faked, at the boundary: a `DOCKER` client that says it
has buildx, has every image, and "builds" by fetching each loopback URL of the pip configuration it
was given (so the servers must be up during the build), then succeeds or fails as the test asks."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "build_image.sh"

FAKE_DOCKER = """#!{python}
import os, re, sys, urllib.request
args = sys.argv[1:]
log = os.environ["FAKE_DOCKER_LOG"]
if args[:2] == ["buildx", "version"]:
    sys.exit(0)
if args[:2] == ["image", "inspect"]:
    print(123456789)
    sys.exit(0)
if args[:2] == ["buildx", "build"]:
    conf = next(a.split("src=", 1)[1] for a in args if a.startswith("id=pip.conf,src="))
    urls = re.findall(r"http://127\\.0\\.0\\.1:[0-9]+/\\S*", open(conf).read())
    with open(log, "a") as f:
        for url in urls:
            status = urllib.request.urlopen(url, timeout=5).status
            f.write(f"{{url}} {{status}}\\n")
    sys.exit(int(os.environ.get("FAKE_DOCKER_BUILD_RC", "0")))
sys.exit(f"fake docker: unexpected {{args}}")
"""


def _servers_of(folder: Path) -> list[psutil.Process]:
    """Processes serving `folder` (python -m http.server --directory <folder or its parent>)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "http.server" in cmd and any(str(folder) in c for c in cmd):
            found.append(p)
    return found


@pytest.mark.parametrize("build_rc", [0, 1], ids=["build-succeeds", "build-fails"])
def test_no_pip_server_outlives_the_build(tmp_path, build_rc):
    wheels = tmp_path / "wheels"  # a find-links folder
    index = tmp_path / "pypi" / "simple"  # a file:// index (its parent is served)
    wheels.mkdir()
    index.mkdir(parents=True)
    (wheels / "w-1.0-py3-none-any.whl").write_bytes(b"x")
    docker = tmp_path / "docker"
    docker.write_text(FAKE_DOCKER.format(python=sys.executable))
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "builds.log"
    env = {
        **os.environ,
        # the script's python3 must have pip; only this test's pip settings (no config files)
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": str(wheels),
        "PIP_EXTRA_INDEX_URL": index.as_uri(),
        "DOCKER": str(docker),
        "BASE": "python:3.11-slim",
        "FAKE_DOCKER_LOG": str(log),
        "FAKE_DOCKER_BUILD_RC": str(build_rc),
    }
    proc = subprocess.run(["bash", str(SCRIPT), "app"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == (0 if build_rc == 0 else 1), proc.stderr
    # both folders were served while the build ran, and answered it
    served = log.read_text().split("\n")
    assert sum(1 for line in served if line.endswith(" 200")) == 2, (served, proc.stderr)
    assert "serving" in proc.stderr
    # and nothing serves them now
    left = _servers_of(tmp_path)
    assert not left, [p.cmdline() for p in left]


def test_the_check_sees_a_server_left_running(tmp_path):
    """The assertion above can fail: a server started the way the script starts one is found."""
    p = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(tmp_path), "0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert [q.pid for q in _servers_of(tmp_path)] == [p.pid]
    finally:
        p.kill()
        p.wait()


def test_the_dockerfile_imports_what_exists():
    """The image's build steps import modules of this tree (a moved module once made the kernel step
    print "not prebuilt" and ship the image without its CPU kernels; the step now fails the build)."""
    import importlib
    import importlib.util
    import re

    text = (REPO / "deploy" / "Dockerfile").read_text()
    imports = re.findall(r"from ([\w.]+) import (\w+)", text)
    assert ("handler.model", "small_gemm") in imports
    for module, name in imports:
        m = importlib.import_module(module)
        assert hasattr(m, name) or importlib.util.find_spec(f"{module}.{name}"), (module, name)
    # the demo adapter step's script, which the Dockerfile copies in
    assert "COPY deploy/image/demo_adapters.py" in text
    spec = importlib.util.spec_from_file_location("image_demo_adapters", REPO / "deploy" / "image" / "demo_adapters.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert callable(script.main)
