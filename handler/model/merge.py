"""Merged mode: fold one adapter into the base weights, W' = W + scale * B @ A.

A replica for a customer whose own traffic fills it runs the merged model at base speed with no
LoRA path at all. The fold is computed in float32 and cast back to the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch

from handler.model.lora import InvalidAdapterWeightsError, lora_scale, parse_peft_weights
from handler.model.runner import LORA_MODULES


@dataclass
class MergedAdapter:
    """The adapter a merged-mode engine folds into its weights (same fields as `mount_adapter`)."""

    adapter_id: str
    weights: Mapping[str, torch.Tensor] | str | Path
    rank: int
    alpha: float
    target_modules: list[str] | None = field(default=None)
    use_rslora: bool = False


@torch.no_grad()
def merge_adapter(
    runner,
    weights: Mapping[str, torch.Tensor],
    rank: int,
    alpha: float,
    target_modules: Iterable[str] | None = None,
    use_rslora: bool = False,
) -> int:
    """Fold a PEFT adapter into `runner`'s weights in place; returns the number of merged matrices."""
    parsed = parse_peft_weights(weights, runner.config)
    if not parsed:
        raise InvalidAdapterWeightsError("the adapter holds no LoRA tensors")
    targets = None if target_modules is None else set(target_modules)
    if targets is not None and targets - set(LORA_MODULES):
        raise InvalidAdapterWeightsError(f"unsupported target modules: {sorted(targets - set(LORA_MODULES))}")
    for (layer, module), ab in sorted(parsed.items()):
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if r > rank:
            raise InvalidAdapterWeightsError(f"layer {layer} {module}: rank {r} exceeds the declared rank {rank}")
        if targets is not None and module not in targets:
            raise InvalidAdapterWeightsError(f"tensors for {module}, which is not in target_modules")
        w = runner.module_weight(layer, module)
        delta = lora_scale(alpha, r, use_rslora) * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32))
        w.copy_((w.float() + delta).to(w.dtype))
    return len(parsed)
