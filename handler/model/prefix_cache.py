"""Which KV blocks are free, in use, or cached: the block pool behind the prefix cache.

A full block of a prompt is named by a chain hash (`chain_hashes`):

    h[0] = H(root, tokens[0:bs]),  h[i] = H(h[i-1], tokens[i*bs:(i+1)*bs]),
    root = H(base model hash, adapter id, tenant salt)

so a block's name covers every token before it and the identity of the weights that computed it.
K and V depend on every adapted projection below them, so KV computed under one adapter (or one
version of it: our adapter ids are immutable and a new version is a new id) is wrong for any other;
keyed on the ids, reuse across adapters is impossible by construction, not by a check that can be
forgotten (vLLM #3264, #30931, #42125; LMCache #44250 shipped without it). The tenant salt keeps one
tenant from ever hitting another's blocks, even on the base model: a hit is faster than a miss, and
shared blocks would tell a tenant what another one sent (a timing side channel).

Every block is in exactly one of three states:
- free: on the free list, zeroed, owned by nobody;
- in use: `refs[b] > 0` requests hold it in their block table (a cached block can be in use by many);
- cached: no reference, but it holds a published full block (`publish`), kept in an LRU so a later
  request with the same chain hash can take it (`match`) instead of prefilling it again.

A request whose next block is not cached may still share its first tokens with a cached block
under the same parent (a chat template's system prompt ends mid-block, and each user's text follows
it): `match_head` finds the published sibling with the longest common token prefix, and the
caller copies those tokens' K and V into the request's own fresh block (copy on write, as SGLang's
token-granular radix cache shares them) instead of computing them again. Siblings are kept sorted
by their tokens, so the longest common prefix is one of the two beside the query's place.

Allocation (`take`) uses free blocks first, then evicts the least recently released cached blocks;
a block with a reference is never evicted, and a block is only ever written by the request that
took it fresh (a match returns full blocks only, a head match is copied out of its block, and a
request always prefills at least its last token itself), so a shared block is never overwritten.
Pure Python: no tensors here; the caller (`handler.model.kvcache.KVCache`) zeroes the blocks this pool
says were recycled.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
from array import array
from typing import Sequence


def chain_root(base: str, adapter_id: str | None, salt: str | None) -> bytes:
    """The hash every chain of one (base, adapter, tenant) starts from."""
    key = "\x00".join((base, adapter_id or "", salt or "")).encode()
    return hashlib.blake2b(key, digest_size=16, person=b"lorafarm-kv-root").digest()


def chain_hashes(tokens: Sequence[int], block_size: int, root: bytes, limit: int | None = None) -> list[bytes]:
    """The chain hashes of the full blocks of `tokens` (at most `limit` of them)."""
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    out, h = [], root
    for i in range(n):
        block = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        out.append(h)
    return out


class BlockPool:
    """Free list, reference counts and the cached-block LRU of `num_blocks` block ids.

    With `caching` off, `publish` does nothing, so a released block is always freed and the pool is
    a plain free list. Not thread-safe by itself: `KVCache` calls it under its lock."""

    def __init__(self, num_blocks: int, caching: bool = True):
        self.num_blocks = num_blocks
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # published block -> its chain hash
        self._block_of: dict[bytes, int] = {}  # chain hash -> the block that holds it
        self._sibling_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # published block -> (parent, tokens)
        self._children: dict[bytes, list[tuple[tuple[int, ...], int]]] = {}  # parent -> sorted (tokens, block)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, oldest first
        self.evictions = 0

    # -- accounting
    @property
    def available(self) -> int:
        """Blocks a `take` can hand out: free plus cached (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def cached(self) -> int:
        """Blocks holding a published chain hash (in use or not)."""
        return len(self._hash_of)

    @property
    def in_use(self) -> int:
        return self.num_blocks - self.available

    # -- allocation
    def take(self, n: int) -> tuple[list[int], list[int]] | None:
        """`n` blocks, referenced once each, and which of them were evicted from the cache (their
        old contents must be cleared). None, and nothing taken, when fewer than `n` are available."""
        if n > self.available:
            return None
        got, recycled = [], []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                self._forget(b)
                self.evictions += 1
                recycled.append(b)
            self.refs[b] = 1
            got.append(b)
        return got, recycled

    def release(self, blocks: Sequence[int]) -> list[int]:
        """Drop one reference to each block. A block nobody holds any more goes to the cached LRU
        (most recently used end) when it was published, else back to the free list; returns the
        freed ones (the caller zeroes them)."""
        freed = []
        for b in blocks:
            r = self.refs[b] - 1
            if r < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.refs[b] = r
            if r:
                continue
            if b in self._hash_of:
                self._lru[b] = None
            else:
                freed.append(b)
        self._free.extend(reversed(freed))
        return freed

    # -- the cache
    def _forget(self, b: int) -> None:
        del self._block_of[self._hash_of.pop(b)]
        sib = self._sibling_of.pop(b, None)
        if sib is not None:
            kids = self._children[sib[0]]
            del kids[bisect.bisect_left(kids, (sib[1], b))]
            if not kids:
                del self._children[sib[0]]

    def _ref(self, b: int) -> None:
        if self.refs[b] == 0:
            del self._lru[b]
        self.refs[b] += 1

    def match(self, hashes: Sequence[bytes], multiple: int = 1) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` whose length is a multiple of
        `multiple`, each referenced once more (so they can no longer be evicted). Release them like
        any other block."""
        n = 0
        while n < len(hashes) and hashes[n] in self._block_of:
            n += 1
        out = [self._block_of[h] for h in hashes[: n - n % multiple]]
        for b in out:
            self._ref(b)
        return out

    def match_head(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(block, n): the published block under chain hash `parent` whose first n tokens equal the
        first n of `tokens`, n as large as any such block has it (at most len(tokens)), referenced
        once more like `match`'s blocks; None when no block shares a first token."""
        kids = self._children.get(parent)
        if not kids or not tokens:
            return None
        q = tuple(tokens)
        i = bisect.bisect_left(kids, (q,))
        best, n = -1, 0
        for t, b in kids[max(0, i - 1) : i + 1]:  # sorted: the longest common prefix is a neighbour
            k = 0
            while k < len(q) and k < len(t) and t[k] == q[k]:
                k += 1
            if k > n:
                best, n = b, k
        if not n:
            return None
        self._ref(best)
        return best, n

    def publish(self, block: int, h: bytes, parent: bytes | None = None, tokens: Sequence[int] = ()) -> bool:
        """Name a full, written block held by its writer by its chain hash, so that it is cached
        when released. False when caching is off, the block is already named, or another block
        already holds this hash (two requests prefilled the same prefix at once: the first keeps it,
        the second block is freed as usual). With its `parent` chain hash and its `tokens`, its head
        can be matched too (`match_head`)."""
        if not self.caching or block in self._hash_of or h in self._block_of:
            return False
        if self.refs[block] <= 0:
            raise RuntimeError(f"KV block {block} published without a reference")
        self._hash_of[block] = h
        self._block_of[h] = block
        if parent is not None and tokens:
            sib = (parent, tuple(tokens))
            self._sibling_of[block] = sib
            bisect.insort(self._children.setdefault(parent, []), (sib[1], block))
        return True
