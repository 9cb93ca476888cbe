"""Paged KV cache, preallocated from a byte budget.

Bytes per token follow the seed's arithmetic: 2 (K and V) x layers x kv_heads x head_dim x bytes
per value. The budget buys `num_blocks` blocks of `block_size` tokens each, allocated once:

    k, v: [layers, num_blocks, block_size, kv_heads, head_dim]

A sequence owns a list of blocks (its block table), allocated as it grows: the engine takes the
blocks of the prompt when it admits a request and one more block each time decoding crosses a
block boundary (`grow`). When the pool runs out the engine preempts the youngest request (its
blocks return to the pool and it is recomputed later, see `handler.engine.engine`). Blocks are released
the moment their request finishes, is cancelled or preempted.

With `prefix_cache`, full prompt blocks are named by chain hashes and outlive their request in an
LRU until the space is needed (`handler.model.prefix_cache`): `match` hands a new request the longest
cached prefix of its prompt, shared by reference, and `publish` names a block once written.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from handler.model.prefix_cache import BlockPool
from handler.model.tensors import to_device, zeroed


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        prefix_cache: bool = False,
    ):
        if num_blocks < 1:
            raise ValueError("the KV cache budget is smaller than one block")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.num_blocks = block_size, num_blocks
        self.dtype, self.device = dtype, torch.device(device)
        # two blocks more than the pool, never handed out: the null block, always zero, pads block
        # tables so a padded key never reads another sequence's values; the scratch block takes the
        # writes of a bucketed step's padding rows (compiled decode), and is never read
        self.null_block = num_blocks
        self.scratch_block = num_blocks + 1
        shape = (num_layers, num_blocks + 2, block_size, num_kv_heads, head_dim)
        # zero pages filled on first touch (CPU): a block nobody used yet takes no memory
        self.k, self.v = zeroed([shape, shape], dtype, self.device)
        self.pool = BlockPool(num_blocks, caching=prefix_cache)
        self._lock = threading.Lock()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """2 x layers x kv_heads x head_dim x bytes per value."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    @classmethod
    def from_budget(cls, config, budget_bytes: int, dtype: torch.dtype, device, block_size: int = 16,
                    prefix_cache: bool = False) -> "KVCache":
        """As many blocks as `budget_bytes` holds for this model config (a `ModelConfig`)."""
        per_token = cls.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        num_blocks = int(budget_bytes) // (per_token * block_size)
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, num_blocks, block_size, dtype, device,
                   prefix_cache)

    @classmethod
    def for_blocks(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                   prefix_cache: bool = False) -> "KVCache":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, num_blocks, block_size, dtype, device,
                   prefix_cache)

    # -- accounting
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: free, or cached and unreferenced (evicted on demand)."""
        return self.pool.available

    @property
    def prefix_cache(self) -> bool:
        return self.pool.caching

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.pool.available

    def allocate(self, tokens: int, have: int = 0) -> list[int] | None:
        """Reserve the blocks for `tokens` tokens beyond the `have` blocks a request already holds
        (its cache hit); None (and nothing reserved) when they do not fit."""
        return self._take(self.blocks_for(tokens) - have)

    def grow(self, blocks: list[int], tokens: int) -> bool:
        """Extend a block table in place to hold `tokens` tokens; False (nothing taken) if the pool
        lacks the blocks."""
        got = self._take(self.blocks_for(tokens) - len(blocks))
        if got is None:
            return False
        blocks.extend(got)
        return True

    def _take(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        with self._lock:
            got = self.pool.take(n)
        if got is None:
            return None
        blocks, recycled = got
        self._zero(recycled)  # evicted cached blocks: full of another prefix's keys
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Release a request's blocks. Blocks nobody holds any more go back to the pool, zeroed: the
        unwritten tail of a block's next owner is masked in attention, but a masked inf or NaN left
        by the previous owner would still turn into NaN (0 * inf) in the softmax-weighted sum.
        Published blocks stay as they are, cached, until evicted (and zeroed then)."""
        with self._lock:
            freed = self.pool.release(blocks)
        self._zero(freed)

    def _zero(self, blocks: list[int]) -> None:
        if blocks:
            idx = to_device(torch.tensor(blocks, dtype=torch.long), self.device)  # no blocking copy
            self.k.index_fill_(1, idx, 0)
            self.v.index_fill_(1, idx, 0)

    def match(self, hashes: list[bytes], multiple: int = 1) -> list[int]:
        """The cached blocks of the longest prefix of these chain hashes (a multiple of `multiple`
        blocks), referenced (see `BlockPool.match`); release them with `free`."""
        with self._lock:
            return self.pool.match(hashes, multiple)

    def match_head(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """A cached block sharing the first n of `tokens` under chain hash `parent`, referenced (see
        `BlockPool.match_head`): copy its head with `copy_head`, then `free` it."""
        with self._lock:
            return self.pool.match_head(parent, tokens)

    def publish(self, block: int, h: bytes, parent: bytes | None = None, tokens: Sequence[int] = ()) -> bool:
        with self._lock:
            return self.pool.publish(block, h, parent, tokens)

    def copy_head(self, src: int, dst: int, n: int) -> None:
        """K and V of the first `n` positions of block `src` into block `dst`, every layer."""
        self.k[:, dst, :n] = self.k[:, src, :n]
        self.v[:, dst, :n] = self.v[:, src, :n]

    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0 (cached blocks nobody holds are free)."""
        return self.pool.in_use / self.num_blocks

    # -- data path
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at flat slots (block * block_size + offset)."""
        self.k[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the sequences in `block_tables` [B, nb]: each [B, kv_heads, nb*bs, D]."""
        B, nb = block_tables.shape
        idx = block_tables.reshape(-1)  # index_select: ~2x faster than advanced indexing on CPU
        k = self.k[layer].index_select(0, idx).view(B, nb * self.block_size, self.num_kv_heads, self.head_dim)
        v = self.v[layer].index_select(0, idx).view(B, nb * self.block_size, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)
