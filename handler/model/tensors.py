"""Tensor helpers the model room shares: a host tensor onto a device without a sync (`to_device`),
zero tensors whose pages the kernel fills on first touch (`zeroed`). torch only: every module of
the room (and the engine's) may import it, it imports none of them."""

from __future__ import annotations

import math
import mmap

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA through pinned memory with a non-blocking copy (the
    copy is ordered on the current stream before any kernel that reads it; no host sync)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def zeroed(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Zero tensors of these shapes. On the CPU they are views of one anonymous memory mapping, which
    the kernel zero-fills page by page on first touch: a page nobody writes takes no memory, where
    `torch.zeros` writes (and so keeps resident) every byte at once. For the LoRA slot stacks that is
    slot 0 of every pool (the no-adapter slot: the kernels never read it) and the slots no adapter
    has used yet: SmolLM2 in float32 allocated 345 MiB of stacks for the 205 MiB of slots the sizing
    counts, 140 MiB of it slot 0."""
    device = torch.device(device)
    if device.type != "cpu":
        return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
    item = torch.empty((), dtype=dtype).element_size()
    align = max(64, item)
    offsets, total = [], 0
    for s in shapes:
        offsets.append(total)
        total += -(-math.prod(s) * item // align) * align
    if total == 0:
        return [torch.zeros(s, dtype=dtype) for s in shapes]
    flat = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8)  # keeps the mapping alive
    return [flat[o:o + math.prod(s) * item].view(dtype).view(s) for o, s in zip(offsets, shapes)]
