"""Memory that decoded packs live in: a region reserved and touched once, carved into packs and given back when
their tensors are gone.

A pack decoded into memory the process has never used pays a page fault per 4 KiB page, and on a virtual machine
whose host backs guest memory lazily the first touch of a page can cost more than the decoding (docs/benchmarks.md,
"Service"). A worker keeps an LRU of ready packs, so until the LRU is full every cold pack is such new memory. As
serving systems reserve their KV memory up front, ``PackMemory`` touches a region once (in the background, from when
the worker starts) and hands out blocks of its touched part; a block returns to the region when the last tensor
viewing it is freed, so an evicted pack's memory serves the next one. ``HostBuffers(memory)`` decodes into it.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np
import torch

ALIGN = 64  # every block starts at a multiple of this


class PackMemory:
    """A region of ``nbytes`` handing out blocks first-fit from the part of it already touched; ``take`` returns None
    when no free run there fits (the caller allocates as usual). ``background``: touch it on a thread of its own
    (it takes about a second a GiB, more on a fresh virtual machine), else now. ``pinned``: page-locked memory a GPU
    copies from at link speed (resident once allocated, so there is nothing to touch; needs CUDA)."""

    TOUCH_STEP = 64 << 20

    def __init__(self, nbytes: int, *, background: bool = False, pinned: bool = False) -> None:
        self.nbytes = nbytes - nbytes % ALIGN
        self._pinned = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True) if pinned and self.nbytes else None
        self._region = self._pinned.numpy() if self._pinned is not None else np.empty(self.nbytes, np.uint8)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)] if self.nbytes else []  # (offset, size), by offset
        self._touched = self.nbytes if pinned else 0  # blocks come from below this
        self._lock = threading.Lock()
        if pinned:
            return
        if background:
            threading.Thread(target=self._touch, name="packstore-pack-memory", daemon=True).start()
        else:
            self._touch()

    def _touch(self) -> None:
        """Write every page of the region, a step at a time, so that packs are never decoded into fresh pages."""
        for start in range(0, self.nbytes, self.TOUCH_STEP):
            stop = min(start + self.TOUCH_STEP, self.nbytes)
            self._region[start:stop].fill(0)
            with self._lock:
                self._touched = stop

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of ``nbytes`` in the region, or None; its block is free again once every tensor made from
        it (views included) is gone."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            fit = next((i for i, (at, free) in enumerate(self._free) if min(free, self._touched - at) >= size), None)
            if fit is None:
                return None
            offset, free = self._free[fit]
            if free == size:
                del self._free[fit]
            else:
                self._free[fit] = (offset + size, free - size)
        block = self._region[offset : offset + nbytes]  # only the tensor's storage refers to it
        weakref.finalize(block, self._give_back, offset, size)
        return torch.from_numpy(block)

    def _give_back(self, offset: int, size: int) -> None:
        """Return a block, merging it with free neighbours."""
        with self._lock:
            at = bisect.bisect_left(self._free, (offset, 0))
            if at < len(self._free) and offset + size == self._free[at][0]:
                size += self._free.pop(at)[1]
            if at > 0 and self._free[at - 1][0] + self._free[at - 1][1] == offset:
                offset, size = self._free[at - 1][0], self._free[at - 1][1] + size
                del self._free[at - 1]
                at -= 1
            self._free.insert(at, (offset, size))
