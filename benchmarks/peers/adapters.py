"""The benchmark's adapters, random PEFT adapters seeded per index (the synthetic adapters of
loadtests/synth.py: same seed, same bytes), written once per model and set under var/peers/adapters/:

- the main set (W2-W5): N rank-16 adapters on all 7 projections, ~19 MB each in float32;
- the Zipf set (W6): 1,000 rank-8 adapters on q/k/v/o_proj only (synth's "attn" targets), ~3.7 MB
  each on SmolLM2-135M, so 1,000 of them fit on disk (3.7 GB a copy: the folders, ours' registry
  store, llama.cpp's GGUF files) and in memory (vLLM's CPU cache, llama-server) and load quickly.

Each names the base folder it belongs to (base_model_name_or_path), which is how `lorafarm up
--adapters` knows what it was trained on."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.synth import synth_specs, write_synth_adapter

RANK = 16
TARGETS = "all"
ZIPF_RANK = 8
ZIPF_TARGETS = "attn"


def adapter_dirs(model_dir: Path, out: Path, count: int, rank: int = RANK, seed: int = 0, progress=True,
                 targets: str = TARGETS) -> list[Path]:
    """`count` adapter folders in `out` (made when missing), in a stable order."""
    from tqdm import tqdm

    model_dir = Path(model_dir).resolve()
    config = json.loads((model_dir / "config.json").read_text())
    specs = synth_specs(count, [rank], targets, seed)
    todo = [s for s in specs if not (out / s.name / "adapter_model.safetensors").exists()]
    for spec in tqdm(todo, desc=f"adapters into {out.name}", unit="adapter", disable=not progress or not todo):
        write_synth_adapter(config, spec, out / spec.name, str(model_dir))
    return [out / spec.name for spec in specs]


def default_dir(root: Path, model_dir: Path, rank: int = RANK, seed: int = 0, targets: str = TARGETS) -> Path:
    # the main set keeps its folder name (no targets in it): caches of earlier runs stay valid
    kind = "" if targets == TARGETS else f"-{targets}"
    return root / "adapters" / f"{Path(model_dir).resolve().name}-r{rank}{kind}-s{seed}"


def zipf_dirs(model_dir: Path, root: Path, count: int, progress=True) -> list[Path]:
    """The W6 set: `count` rank-8 attention-only adapters (see the module docstring)."""
    out = default_dir(root, model_dir, ZIPF_RANK, targets=ZIPF_TARGETS)
    return adapter_dirs(model_dir, out, count, ZIPF_RANK, progress=progress, targets=ZIPF_TARGETS)


def weights_bytes(dirs: list[Path]) -> int:
    """Bytes of the adapters' weight files (adapter_model.safetensors)."""
    return sum((d / "adapter_model.safetensors").stat().st_size for d in dirs)
