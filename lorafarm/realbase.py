"""`lorafarm up --base [NAME=]DIR --adapters DIR...`: real Hugging Face checkpoints and real PEFT
adapters instead of the generated dev model and canaries.

Checks before anything starts: the folder holds a config.json of a supported architecture
(Llama, Mistral, Qwen2: the replica's runner) and safetensors weights (one file or shards with
their index); each adapter is a PEFT LoRA folder and says which base it was trained on: a
`base_model_hash.txt` beside it (`lorafarm archive basehash BASE --write ADAPTER`), or its
adapter_config.json's `base_model_name_or_path` naming one of the served folders. Otherwise the
farm refuses to start unless `--assume-base` is given.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lorafarm.errors import CliError

SUPPORTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def parse_base(value: str) -> tuple[str, Path]:
    """`NAME=DIR` or `DIR` (the name is then the folder's name)."""
    name, sep, folder = value.partition("=")
    if not sep:
        name, folder = "", value
    path = Path(folder).expanduser()
    name = name or path.resolve().name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}", name):
        raise CliError(f"--base {value}: {name!r} is not a usable model name ([A-Za-z0-9._/-])")
    return name, path


def check_checkpoint(name: str, path: Path) -> dict:
    """The checkpoint's config.json; CliError naming the problem (and the architecture) otherwise."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CliError(f"--base {name}={path}: no config.json there (a Hugging Face model folder is expected)")
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError:
        raise CliError(f"--base {name}={path}: config.json is not valid JSON") from None
    model_type = str(config.get("model_type") or "?")
    if model_type not in SUPPORTED:
        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise CliError(f"--base {name}={path}: {arch} (model_type {model_type!r}) is not supported; lorafarm "
                       f"serves {', '.join(SUPPORTED.values())} checkpoints")
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        if list(path.glob("*.bin")) or list(path.glob("*.pth")):
            raise CliError(f"--base {name}={path}: only pickle weights (*.bin); lorafarm loads safetensors only "
                           "(re-save with save_pretrained(..., safe_serialization=True))")
        raise CliError(f"--base {name}={path}: no model.safetensors or model.safetensors.index.json")
    return config


def find_adapters(paths: list[Path]) -> list[Path]:
    """PEFT folders: each path is one, or a folder of them (one level down)."""
    found: list[Path] = []
    for p in paths:
        if (p / "adapter_config.json").is_file():
            found.append(p)
            continue
        subs = sorted(d for d in p.iterdir() if (d / "adapter_config.json").is_file()) if p.is_dir() else []
        if not subs:
            raise CliError(f"--adapters {p}: not a PEFT adapter folder (no adapter_config.json) nor a folder of them")
        found += subs
    names = [alias_name(p) for p in found]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CliError(f"--adapters: two adapters would get the same alias name {dupes[0]!r}; rename a folder")
    return found


def alias_name(adapter_dir: Path) -> str:
    """The alias name part for a folder: its name, reduced to [A-Za-z0-9._-]."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", adapter_dir.resolve().name).strip("-._") or "adapter"
    return name[:100]


def trained_on(adapter_dir: Path, bases: dict[str, tuple[Path, str]]) -> str | None:
    """The base hash the adapter says it was trained on, or None when it says nothing we can check.
    `bases`: served name -> (folder, hash)."""
    from archives.basehash import read_trained_base
    from archives.errors import ArchiveError

    try:
        recorded = read_trained_base(adapter_dir)
    except ArchiveError as e:
        raise CliError(f"--adapters {adapter_dir}: {e}") from None
    if recorded:
        return recorded
    try:
        named = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except ValueError:
        raise CliError(f"--adapters {adapter_dir}: adapter_config.json is not valid JSON") from None
    if named:
        for name, (folder, h) in bases.items():
            if named == name or Path(named).expanduser().resolve() == folder.resolve():
                return h
    return None
