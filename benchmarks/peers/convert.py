"""Our model and PEFT adapters as GGUF files for llama.cpp, with the converters shipped in the
llama-cpp-python sdist's vendored llama.cpp (`convert_hf_to_gguf.py`, `convert_lora_to_gguf.py`),
run by our venv's python (gguf, torch, transformers are there; plus sentencepiece, which the
converters import: install.converter_python). float32 throughout: the same weights every peer
serves. Each file is written once (to a temporary name, then renamed); the adapters of a run in one
converter process (lora_batch.py). The W6 set (--zipf-adapters) goes to a folder of its own.

    python -m benchmarks.peers.convert --model DIR --adapters 32 [--zipf-adapters 1000] [--root var/peers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.peers import PEERS_ROOT
from benchmarks.peers.adapters import ZIPF_RANK, ZIPF_TARGETS, adapter_dirs, default_dir, zipf_dirs
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


def lora_file(out_dir: Path, name: str) -> Path:
    return out_dir / f"{name}-f32.gguf"


def convert_adapters(model_dir: Path, adapters: list[Path], out_dir: Path, source: Path, python: Path,
                     progress=True) -> dict[str, Path]:
    """adapter folder name -> its GGUF LoRA file; the missing ones converted in one process."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    script = _converter(source, "convert_lora_to_gguf.py")
    done = {a.name: lora_file(out_dir, a.name) for a in adapters}
    todo = [[str(done[a.name]), str(a.resolve())] for a in adapters if not done[a.name].exists()]
    if not todo:
        return done
    log = out_dir / "convert.log"
    cmd = [str(python), str(Path(__file__).with_name("lora_batch.py")), str(script), str(Path(model_dir).resolve())]
    bar = tqdm(total=len(todo), desc="adapters to GGUF", unit="adapter", disable=not progress)
    with open(log, "a") as f, bar:
        f.write(f"$ {' '.join(cmd)} < {len(todo)} adapters\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True)
        proc.stdin.write(json.dumps(todo))
        proc.stdin.close()
        for _ in proc.stdout:  # a line per file written
            bar.update(1)
        rc = proc.wait()
    if rc != 0:
        missing = next((Path(o).name for o, _ in todo if not Path(o).exists()), "the adapters")
        raise CliError(f"converting into {missing} failed (status {rc}); see {log}")
    return done


def zipf_gguf_dir(root: Path, model_dir: Path) -> Path:
    """The W6 set's GGUF files, in a folder named after its adapters' folder: their names (synth-NNNNN)
    are the main set's too."""
    return gguf_dir(root, model_dir) / default_dir(root, model_dir, ZIPF_RANK, targets=ZIPF_TARGETS).name


def convert_all(model_dir: Path, count: int, zipf: int = 0, root: Path = PEERS_ROOT,
                progress=True) -> tuple[Path, list[Path]]:
    """The base, the main set's `count` adapters and the W6 set's `zipf`: (base, LoRA files)."""
    source, python = llamacpp_source(root), converter_python(root)
    out_dir = gguf_dir(root, model_dir)
    base = convert_base(model_dir, out_dir, source, python)
    adapters = adapter_dirs(model_dir, default_dir(root, model_dir), count, progress=progress)
    loras = list(convert_adapters(model_dir, adapters, out_dir, source, python, progress=progress).values())
    if zipf:
        pool = zipf_dirs(model_dir, root, zipf, progress=progress)
        zipf_dir = zipf_gguf_dir(root, model_dir)
        loras += convert_adapters(model_dir, pool, zipf_dir, source, python, progress=progress).values()
    return base, loras


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the Hugging Face model folder (lorafarm realmodel --out)")
    p.add_argument("--adapters", type=int, default=32, help="how many random rank-16 adapters")
    p.add_argument("--zipf-adapters", type=int, default=0, help="how many rank-8 adapters of W6's set (default 0)")
    p.add_argument("--root", type=Path, default=PEERS_ROOT)
    args = p.parse_args(argv)
    try:
        if not (args.model / "config.json").is_file():
            raise CliError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
        if args.adapters < 0 or args.zipf_adapters < 0:
            raise CliError("--adapters and --zipf-adapters must be 0 or more")
        base, loras = convert_all(args.model, args.adapters, args.zipf_adapters, args.root)
    except CliError as e:
        print(f"peers convert: {e}", file=sys.stderr)
        return 2
    print(f"{base} and {len(loras)} LoRA files in {base.parent}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
