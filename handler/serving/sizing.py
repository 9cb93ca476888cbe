"""The replica's memory defaults from the model and the machine, when the flags do not say.

Before this, every replica took a 2 GiB KV cache (32 requests x 2,048 tokens, capped) and four rank
pools of 8 slots whatever the model: 4.3 GB of RSS for SmolLM2-135M on a CPU. Now:

- KV cache: enough for `max_batch` requests of min(context, 2,048) tokens, but at most
  - on the CPU: half the weights' bytes or 2% of the machine's RAM, whichever is less (several
    replicas share a host, and a CPU decodes few long contexts at once), at least 64 MiB, at most 2 GiB;
  - on CUDA: half of what the device holds beyond the weights (90% of its memory), at least 256 MiB.
- Adapter slots from a byte budget (CPU: 40% of the weights' bytes or 2% of the machine's RAM,
  whichever is more, at least 64 MiB; CUDA: 10% of the device memory beyond the weights): one slot in
  every rank pool up to the rank limit (so any accepted rank loads), then the smallest ranks first up
  to 8 slots a pool (the old default). The RAM share is for small models: with 40% of SmolLM2-135M's
  weights alone (216 MB) the pools were 8:8, 16:1, 32:1, 64:1, and in the real-model load test (ranks
  8/16/32 in the shares 60/30/10) every rank-16 and rank-32 adapter queued for its pool's one slot.

Each pool also has a slot 0 (the no-adapter slot), not counted: the kernels never read it and its
pages are never written, so on the CPU it takes no memory (handler.model.runner.zeroed); nor do slots no
adapter has used yet. The weights are counted once: the runner holds no file mapping
(handler.model.runner.Checkpoint).

`--kv-cache-bytes`, `--slots`, `--rank-pools` and `--lora-memory-bytes` override these.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024**2
GiB = 1024**3
POOL_RANKS = (8, 16, 32, 64)
MAX_SLOTS = 8


@dataclass(frozen=True)
class Sizing:
    kv_cache_bytes: int
    rank_pools: dict[int, int]
    weights_bytes: int
    lora_bytes: int
    memory_bytes: int  # the machine's RAM (cpu) or the device's memory (cuda)

    def describe(self) -> str:
        pools = ",".join(f"{r}:{s}" for r, s in sorted(self.rank_pools.items()))
        return (f"weights {self.weights_bytes / MiB:.0f} MiB, KV cache {self.kv_cache_bytes / MiB:.0f} MiB, "
                f"adapter slots {self.lora_bytes / MiB:.0f} MiB (rank pools {pools}), "
                f"of {self.memory_bytes / GiB:.1f} GiB")


def _dims(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return (int(cfg["num_hidden_layers"]), hidden, int(cfg["intermediate_size"]), heads, kv_heads, head_dim,
            int(cfg["vocab_size"]))


def weights_bytes(cfg: dict, dtype_bytes: int) -> int:
    """Parameters x bytes of a Llama-family decoder (embeddings, layers, norms, output unless tied)."""
    layers, hidden, mlp, heads, kv_heads, head_dim, vocab = _dims(cfg)
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attn + 3 * hidden * mlp + 2 * hidden
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        per_layer += heads * head_dim + 2 * kv_heads * head_dim
    out = 0 if cfg.get("tie_word_embeddings") else vocab * hidden
    return (vocab * hidden + layers * per_layer + hidden + out) * dtype_bytes


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    layers, _, _, _, kv_heads, head_dim, _ = _dims(cfg)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def slot_bytes(cfg: dict, rank: int, dtype_bytes: int) -> int:
    """One rank-`rank` slot over all 7 targetable modules of every layer."""
    layers, hidden, mlp, heads, kv_heads, head_dim, _ = _dims(cfg)
    q, kv = heads * head_dim, kv_heads * head_dim
    io = (hidden + q) * 2 + (hidden + kv) * 2 + (hidden + mlp) * 3
    return rank * layers * io * dtype_bytes


def machine_memory(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    import psutil

    total = int(psutil.virtual_memory().total)
    try:  # a container's memory limit (cgroup v2), when lower
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def size_replica(cfg: dict, *, dtype_bytes: int, device: str, max_batch: int, rank_limit: int,
                 memory_bytes: int | None = None) -> Sizing:
    mem = machine_memory(device) if memory_bytes is None else int(memory_bytes)
    weights = weights_bytes(cfg, dtype_bytes)
    cuda = device.startswith("cuda")
    ctx = min(int(cfg.get("max_position_embeddings") or 2048), 2048)
    want = max_batch * ctx * kv_bytes_per_token(cfg, dtype_bytes)
    if cuda:
        spare = max(0, int(mem * 0.9) - weights)
        kv = min(want, max(256 * MiB, spare // 2))
        lora_budget = max(256 * MiB, spare // 10)
    else:
        kv = min(want, max(64 * MiB, min(weights // 2, mem // 50)), 2 * GiB)
        lora_budget = max(64 * MiB, weights * 2 // 5, mem // 50)
    ranks = [r for r in POOL_RANKS if r <= rank_limit] or [rank_limit]
    pools = {r: 1 for r in ranks}
    used = sum(slot_bytes(cfg, r, dtype_bytes) for r in ranks)
    for r in ranks:  # the smallest ranks first: most adapters are small
        cost = slot_bytes(cfg, r, dtype_bytes)
        while pools[r] < MAX_SLOTS and used + cost <= lora_budget:
            pools[r] += 1
            used += cost
    return Sizing(kv_cache_bytes=int(kv), rank_pools=pools, weights_bytes=weights, lora_bytes=used, memory_bytes=mem)
