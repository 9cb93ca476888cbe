"""The slot table: which adapter is mounted in which device slot of `handler.model.lora`, and who uses it.

Owns the engine's bookkeeping of mounted adapters: the free slots of every rank pool, the adapters
being mounted now (a second mount of the same id waits for the first), each mounted adapter's slot,
rank and references (its waiting and running requests: an adapter with references is never
unmounted), and the copy of an adapter's weights into a slot no running request reads. A merged-mode
engine (one adapter folded into the base weights) has no slots; its adapter id is "mounted" forever.

Every method takes the engine's lock (an RLock shared with the other pieces); `acquire` and
`release` run under it, called by the engine and the output processor.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from handler.engine.errors import (
    AdapterInUseError,
    InvalidAdapterError,
    NoFreeSlotError,
    UnknownAdapterError,
)
from handler.model.lora import InvalidAdapterWeightsError, ModelLoRA, SlotImage, read_peft_adapter

log = logging.getLogger(__name__)


@dataclass
class Mounted:
    slot: int
    rank: int
    pool_rank: int
    refs: int = 0


class SlotTable:
    def __init__(self, lora: ModelLoRA | None, merged_adapter_id: str | None, device: torch.device,
                 lock: threading.RLock, cond: threading.Condition):
        self.lora, self.merged_adapter_id = lora, merged_adapter_id
        self._lock, self._cond = lock, cond
        self.adapters: dict[str, Mounted] = {}
        self.loading: dict[str, threading.Event] = {}  # adapter id -> set once its mount ends
        self.free: dict[int, list[int]] = {}  # pool rank -> free slots (popped from the end)
        if lora is not None:
            for i, (r, _) in enumerate(lora.pools):
                self.free[r] = list(reversed(lora.slots_of_pool(i)))
        self._device = device
        self._copy_stream = None  # CUDA: the side stream adapter mounts copy on
        self._copy = self._copy_on_side_stream if device.type == "cuda" else self._write

    # ------------------------------------------------------------------------------- lookups

    def pool_rank_for(self, rank: int) -> int:
        """The rank of the pool an adapter of this rank goes to; InvalidAdapterError if none fits."""
        if self.lora is None:
            raise InvalidAdapterError("this engine has no adapter slots (merged mode or rank_pools={})")
        try:
            return self.lora.pool_rank_for(int(rank))
        except ValueError as e:
            raise InvalidAdapterError(str(e)) from None

    def free_slots(self, rank: int) -> int:
        """Free slots in the pool that an adapter of this rank would use (0 when none fits)."""
        try:
            pr = self.pool_rank_for(rank)
        except InvalidAdapterError:
            return 0
        with self._lock:
            return len(self.free[pr])

    def free_counts(self) -> dict[int, int]:
        """Pool rank -> free slots (the caller holds the lock)."""
        return {r: len(s) for r, s in self.free.items()}

    def mounted(self) -> list[str]:
        with self._lock:
            if self.merged_adapter_id is not None:
                return [self.merged_adapter_id]
            return sorted(self.adapters)

    def count(self) -> int:
        """Mounted adapters, the merged one included (the caller holds the lock)."""
        return len(self.adapters) + (self.merged_adapter_id is not None)

    def is_mounted(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self.adapters or adapter_id == self.merged_adapter_id

    def refs(self, adapter_id: str) -> int:
        """Waiting + running requests of a mounted adapter (0 when not mounted)."""
        with self._lock:
            m = self.adapters.get(adapter_id)
            return m.refs if m else 0

    # ------------------------------------------------------------------------------- references

    def acquire(self, adapter_id: str | None) -> int:
        """A new request's reference to its adapter: the adapter's slot (0: the base alone).
        UnknownAdapterError when it is not mounted. The caller holds the lock."""
        if self.merged_adapter_id is not None:
            if adapter_id != self.merged_adapter_id:
                raise UnknownAdapterError(
                    f"this merged-mode engine serves only adapter {self.merged_adapter_id}, not {adapter_id}"
                )
            return 0
        if adapter_id is None:
            return 0
        m = self.adapters.get(adapter_id)
        if m is None:
            raise UnknownAdapterError(f"adapter {adapter_id} is not mounted")
        m.refs += 1
        return m.slot

    def release(self, adapter_id: str | None) -> None:
        """A finished request lets its adapter go (the caller holds the lock)."""
        if adapter_id is not None and adapter_id in self.adapters:
            self.adapters[adapter_id].refs -= 1

    # ------------------------------------------------------------------------------- mounts

    def prepare(self, weights: Mapping[str, torch.Tensor], *, rank: int, alpha: float,
                target_modules: Iterable[str] | None = None, use_rslora: bool = False,
                pin_memory: bool = False) -> SlotImage:
        """Validate an adapter and lay it out for a slot of its rank pool, in host memory."""
        self.pool_rank_for(rank)
        try:
            return self.lora.build_image(weights, int(rank), float(alpha), target_modules, use_rslora,
                                         pin_memory=pin_memory)
        except InvalidAdapterWeightsError as e:
            raise InvalidAdapterError(str(e)) from None

    def mount(self, adapter_id: str, weights: Mapping[str, torch.Tensor] | SlotImage | str | Path, *, rank: int,
              alpha: float, target_modules: Iterable[str] | None = None, use_rslora: bool = False) -> int:
        """Copy an adapter into a free slot of its rank pool; its slot (`Engine.mount_adapter`)."""
        if self.merged_adapter_id is not None:
            if adapter_id == self.merged_adapter_id:
                return 0
            raise NoFreeSlotError("merged-mode engine: no adapter slots")
        pool_rank = self.pool_rank_for(rank)
        if isinstance(weights, (str, Path)):
            weights = read_peft_adapter(weights).weights
        slot, done = self._reserve(adapter_id, pool_rank, rank)
        if done is None:
            return slot  # already mounted
        try:
            self._copy(slot, weights, int(rank), float(alpha), target_modules, use_rslora)
        except BaseException as e:
            with self._lock:
                self.lora.reset_adapter(slot)
                self.free[pool_rank].append(slot)
                del self.loading[adapter_id]
                done.set()
            if isinstance(e, InvalidAdapterWeightsError):
                raise InvalidAdapterError(f"{adapter_id}: {e}") from None
            raise
        with self._lock:
            self.adapters[adapter_id] = Mounted(slot, int(rank), pool_rank)
            del self.loading[adapter_id]
            done.set()
        log.info("mounted adapter %s (rank %d) in slot %d of the rank-%d pool", adapter_id, rank, slot, pool_rank)
        return slot

    def _reserve(self, adapter_id: str, pool_rank: int, rank: int) -> tuple[int, threading.Event | None]:
        """(slot, event to set once mounted) of a free slot taken for the adapter, or (its slot, None)
        when it is mounted already; waits while another thread mounts the same id."""
        while True:
            with self._lock:
                if adapter_id in self.adapters:
                    return self.adapters[adapter_id].slot, None
                pending = self.loading.get(adapter_id)
                if pending is None:
                    if not self.free[pool_rank]:
                        raise NoFreeSlotError(
                            f"no free slot in the rank-{pool_rank} pool for {adapter_id} (rank {rank})"
                        )
                    slot = self.free[pool_rank].pop()
                    self.loading[adapter_id] = threading.Event()
                    return slot, self.loading[adapter_id]
            pending.wait()  # another thread is mounting the same id

    def _write(self, slot: int, weights, rank: int, alpha: float, target_modules, use_rslora: bool) -> None:
        if isinstance(weights, SlotImage):
            self.lora.write_image(slot, weights)
        else:
            self.lora.set_adapter(slot, weights, rank, alpha, target_modules, use_rslora)

    def _copy_on_side_stream(self, slot: int, weights, rank: int, alpha: float, target_modules,
                             use_rslora: bool) -> None:
        """Copy into a slot no running request reads, on CUDA: the copies run on a side stream that
        first waits (on the GPU) for the work already queued on the compute stream, which may still
        read the slot's previous adapter; this thread then waits for the copies' event only. The
        compute stream is never synchronized, so decode steps go on meanwhile."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self._device)
        self._copy_stream.wait_stream(torch.cuda.default_stream(self._device))
        with torch.cuda.stream(self._copy_stream):
            self._write(slot, weights, rank, alpha, target_modules, use_rslora)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()

    def unmount(self, adapter_id: str) -> None:
        """Free the adapter's slot. AdapterInUseError while requests use it; UnknownAdapterError if absent."""
        with self._lock:
            m = self.adapters.get(adapter_id)
            if m is None:
                raise UnknownAdapterError(f"adapter {adapter_id} is not mounted")
            if m.refs > 0:
                raise AdapterInUseError(f"adapter {adapter_id} has {m.refs} waiting or running requests")
            del self.adapters[adapter_id]
            self.lora.reset_adapter(m.slot)
            self.free[m.pool_rank].append(m.slot)
            self._cond.notify_all()
        log.info("unmounted adapter %s from slot %d", adapter_id, m.slot)
