"""The benchmark's adapters: N random rank-16 PEFT adapters on all 7 projections, seeded (the
synthetic adapters of loadtests/synth.py: same seed, same bytes), written once per model under
var/peers/adapters/. Each names the base folder it belongs to (base_model_name_or_path), which is
how `lorafarm up --adapters` knows what it was trained on."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.synth import synth_specs, write_synth_adapter

RANK = 16


def adapter_dirs(model_dir: Path, out: Path, count: int, rank: int = RANK, seed: int = 0, progress=True) -> list[Path]:
    """`count` adapter folders in `out` (made when missing), in a stable order."""
    from tqdm import tqdm

    model_dir = Path(model_dir).resolve()
    config = json.loads((model_dir / "config.json").read_text())
    specs = synth_specs(count, [rank], "all", seed)
    dirs = []
    todo = [s for s in specs if not (out / s.name / "adapter_model.safetensors").exists()]
    for spec in tqdm(todo, desc="adapters", unit="adapter", disable=not progress or not todo):
        write_synth_adapter(config, spec, out / spec.name, str(model_dir))
    for spec in specs:
        dirs.append(out / spec.name)
    return dirs


def default_dir(root: Path, model_dir: Path, rank: int = RANK, seed: int = 0) -> Path:
    return root / "adapters" / f"{Path(model_dir).resolve().name}-r{rank}-s{seed}"
