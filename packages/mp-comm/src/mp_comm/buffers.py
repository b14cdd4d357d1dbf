"""Persistent transfer buffers and their manager, for the device-to-device path (docs/comm.md).

Cross-process CUDA copies and RDMA need memory handles or registrations for the memory they touch,
and creating those costs far more than a copy. The D2D path therefore lands every incoming device
tensor in one persistent receive buffer (and, across nodes, sends every outgoing one from one
persistent send buffer) that is allocated once and registered once, the first time it is used, and
reuses it for every transfer. :class:`BufferManager` hands out regions of such a buffer first-fit and
takes them back, coalescing neighbours. A transfer that finds no room is not queued: the transport
takes another path (the MPI fallback), so that a full buffer never stalls a sender.

:class:`HostPool` is the host-side counterpart for received CPU tensors: it recycles their memory
once the tensors die, so that large receives do not pay the page faults of fresh memory.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["BufferManager", "HostPool", "Region"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Region:
    """`nbytes` bytes at `offset` of a managed buffer (the reserved size is rounded up to the alignment)."""

    offset: int
    nbytes: int
    reserved: int


class BufferManager:
    """First-fit allocator over one persistent buffer of `capacity` bytes on `device`.

    The buffer's memory is allocated the first time it is used (`buffer`, `view`), not at
    construction, so a rank that never moves device tensors never pays for it. Every region starts
    at a multiple of `alignment` bytes (256 by default: enough for any dtype and for coalesced
    device access). Thread-safe.
    """

    def __init__(self, capacity: int, device: torch.device | str, *, alignment: int = 256) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity}; expected a number of bytes >= 0 (0 disables the buffer)")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment={alignment}; expected a power of two")
        self.capacity = capacity
        self.device = torch.device(device)
        self.alignment = alignment
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        # Free holes as parallel sorted lists of offsets and sizes.
        self._hole_offsets: list[int] = [0] if capacity else []
        self._hole_sizes: list[int] = [capacity] if capacity else []
        self._used = 0

    @property
    def buffer(self) -> torch.Tensor:
        """The persistent buffer (a flat uint8 tensor), allocated on first access."""
        if self._buffer is None:
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device, pin_memory=pin)
            log.debug("allocated a %d-byte persistent buffer on %s", self.capacity, self.device)
        return self._buffer

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    @property
    def used(self) -> int:
        """Bytes reserved now (alignment padding included)."""
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    @property
    def largest_free(self) -> int:
        """The largest region a single reserve could get now."""
        with self._lock:
            return max(self._hole_sizes, default=0)

    def _round(self, nbytes: int) -> int:
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    def reserve(self, nbytes: int) -> Region | None:
        """A region of at least `nbytes`, or None when no hole is large enough."""
        regions = self.reserve_all([nbytes])
        return None if regions is None else regions[0]

    def reserve_all(self, sizes: Sequence[int]) -> list[Region] | None:
        """Regions for every size, or None (and nothing reserved) when they do not all fit."""
        if any(n < 0 for n in sizes):
            raise ValueError(f"sizes={list(sizes)}; region sizes must be >= 0")
        with self._lock:
            taken: list[Region] = []
            for n in sizes:
                region = self._take(n)
                if region is None:
                    for r in taken:
                        self._give(r)
                    return None
                taken.append(region)
            return taken

    def release(self, region: Region) -> None:
        """Return a region reserved from this manager."""
        with self._lock:
            self._give(region)

    def view(self, region: Region) -> torch.Tensor:
        """The region's `nbytes` bytes of the buffer, as a flat uint8 tensor (no copy)."""
        return self.buffer.narrow(0, region.offset, region.nbytes)

    def _take(self, nbytes: int) -> Region | None:
        need = self._round(nbytes)
        for i, size in enumerate(self._hole_sizes):
            if size >= need:
                offset = self._hole_offsets[i]
                if size == need:
                    del self._hole_offsets[i]
                    del self._hole_sizes[i]
                else:
                    self._hole_offsets[i] = offset + need
                    self._hole_sizes[i] = size - need
                self._used += need
                return Region(offset, nbytes, need)
        return None

    def _give(self, region: Region) -> None:
        offset, size = region.offset, region.reserved
        i = bisect.bisect_left(self._hole_offsets, offset)
        if i < len(self._hole_offsets) and self._hole_offsets[i] == offset:
            raise ValueError(f"region at offset {offset} was released twice")
        self._hole_offsets.insert(i, offset)
        self._hole_sizes.insert(i, size)
        self._used -= size
        # Coalesce with the following hole, then with the preceding one.
        if i + 1 < len(self._hole_offsets) and offset + size == self._hole_offsets[i + 1]:
            self._hole_sizes[i] += self._hole_sizes.pop(i + 1)
            self._hole_offsets.pop(i + 1)
        if i > 0 and self._hole_offsets[i - 1] + self._hole_sizes[i - 1] == offset:
            self._hole_sizes[i - 1] += self._hole_sizes.pop(i)
            self._hole_offsets.pop(i)

    def __repr__(self) -> str:
        return (
            f"BufferManager(capacity={self.capacity}, device={self.device}, used={self._used}, "
            f"holes={len(self._hole_sizes)})"
        )


class HostPool:
    """Recycled host memory for received tensors: a buffer comes back when the tensor built on it dies.

    A receiver allocates a fresh tensor for every message, and fresh host memory costs a page fault
    (and the kernel's zeroing) per 4 KiB page the first time it is written: for large payloads, which
    malloc maps anew each time, that costs several times the transfer itself (64 MB here: 25 ms to
    allocate and fill, 4.7 ms from the pool). Its own bookkeeping costs ~10 µs a tensor, more than
    malloc's reuse of smaller blocks: callers choose `min_bytes` by measurement. The pool hands out
    buffers of exactly the requested size, keyed by size (a pipeline repeats its sizes), and takes a
    buffer back when the last tensor viewing it is garbage collected. It holds at most `capacity`
    bytes of idle buffers, dropping the oldest first; buffers smaller than `min_bytes` are not pooled.
    Thread-safe (buffers come back on whichever thread drops the last reference).
    """

    def __init__(self, capacity: int = 256 << 20, *, min_bytes: int = 64 << 10) -> None:
        if capacity < 0 or min_bytes < 0:
            raise ValueError(f"capacity={capacity}, min_bytes={min_bytes}; expected sizes >= 0")
        self.capacity = capacity
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._idle: collections.OrderedDict[int, tuple[int, Any]] = collections.OrderedDict()
        self._by_size: dict[int, list[int]] = {}
        self._held = 0
        self.hits = 0
        self.misses = 0

    @property
    def held(self) -> int:
        """Bytes of idle buffers in the pool now."""
        return self._held

    def tensor(
        self, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, nbytes: int
    ) -> torch.Tensor:
        """An uninitialized CPU tensor of this layout (its storage exactly `nbytes`), from the pool when
        it has a buffer of that size."""
        if nbytes < max(1, self.min_bytes) or self.capacity == 0:
            return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
        base = self._take(nbytes)
        view = base[:]  # the tensor keeps this view alive; when it dies, `base` comes back
        weakref.finalize(view, self._give_back, base)
        storage = torch.from_numpy(view).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), tuple(stride))

    def _take(self, nbytes: int) -> Any:
        with self._lock:
            ids = self._by_size.get(nbytes)
            if ids:
                key = ids.pop()
                _, base = self._idle.pop(key)
                self._held -= nbytes
                self.hits += 1
                return base
            self.misses += 1
        return np.empty(nbytes, dtype=np.uint8)

    def _give_back(self, base: Any) -> None:
        nbytes = int(base.nbytes)
        with self._lock:
            if nbytes > self.capacity:
                return
            while self._held + nbytes > self.capacity and self._idle:
                key, (size, _) = self._idle.popitem(last=False)
                self._by_size[size].remove(key)
                self._held -= size
            key = id(base)
            self._idle[key] = (nbytes, base)
            self._by_size.setdefault(nbytes, []).append(key)
            self._held += nbytes

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            self._idle.clear()
            self._by_size.clear()
            self._held = 0
