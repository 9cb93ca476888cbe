"""Our model and PEFT adapters as GGUF files for llama.cpp, with the converters shipped in the
llama-cpp-python sdist's vendored llama.cpp (`convert_hf_to_gguf.py`, `convert_lora_to_gguf.py`),
run by our venv's python (gguf, torch, transformers are there; plus sentencepiece, which the
converters import: install.converter_python). float32 throughout: the same
weights every peer serves. Each file is written once (to a temporary name, then renamed).

    python -m benchmarks.peers.convert --model DIR --adapters 32 [--root var/peers]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.peers import PEERS_ROOT
from benchmarks.peers.adapters import adapter_dirs, default_dir
from benchmarks.peers.install import converter_python, llamacpp_source
from lorafarm.errors import CliError


def _converter(source: Path, name: str) -> Path:
    script = source / "vendor" / "llama.cpp" / name
    if not script.is_file():
        raise CliError(f"{script} is missing: run `python -m benchmarks.peers.install --peers llamacpp` first")
    return script


def _convert(cmd: list, out: Path, log: Path) -> Path:
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".part")
    cmd = [str(c) if c != out else str(tmp) for c in cmd]
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not tmp.exists():
        raise CliError(f"converting into {out.name} failed (status {rc}); see {log}")
    os.replace(tmp, out)
    return out


def gguf_dir(root: Path, model_dir: Path) -> Path:
    return root / "gguf" / Path(model_dir).resolve().name


def convert_base(model_dir: Path, out_dir: Path, source: Path, python: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "base-f32.gguf"
    return _convert([python, _converter(source, "convert_hf_to_gguf.py"), Path(model_dir).resolve(),
                     "--outtype", "f32", "--outfile", out], out, out_dir / "convert.log")


def convert_adapters(model_dir: Path, adapters: list[Path], out_dir: Path, source: Path, python: Path,
                     progress=True) -> dict[str, Path]:
    """adapter folder name -> its GGUF LoRA file."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    script = _converter(source, "convert_lora_to_gguf.py")
    done = {}
    for a in tqdm(adapters, desc="adapters to GGUF", unit="adapter", disable=not progress):
        out = out_dir / f"{a.name}-f32.gguf"
        done[a.name] = _convert([python, script, "--base", Path(model_dir).resolve(), "--outtype", "f32",
                                 "--outfile", out, a.resolve()], out, out_dir / "convert.log")
    return done


def convert_all(model_dir: Path, count: int, root: Path = PEERS_ROOT, progress=True) -> tuple[Path, dict[str, Path]]:
    source, python = llamacpp_source(root), converter_python(root)
    adapters = adapter_dirs(model_dir, default_dir(root, model_dir), count, progress=progress)
    out_dir = gguf_dir(root, model_dir)
    base = convert_base(model_dir, out_dir, source, python)
    return base, convert_adapters(model_dir, adapters, out_dir, source, python, progress=progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the Hugging Face model folder (lorafarm realmodel --out)")
    p.add_argument("--adapters", type=int, default=32, help="how many random rank-16 adapters")
    p.add_argument("--root", type=Path, default=PEERS_ROOT)
    args = p.parse_args(argv)
    try:
        if not (args.model / "config.json").is_file():
            raise CliError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
        if args.adapters < 0:
            raise CliError("--adapters must be 0 or more")
        base, loras = convert_all(args.model, args.adapters, args.root)
    except CliError as e:
        print(f"peers convert: {e}", file=sys.stderr)
        return 2
    print(f"{base} and {len(loras)} LoRA files in {base.parent}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
