"""Where decoded tensors live: the buffer provider a ``Decoder`` hands every pack it decodes.

The provider is the seam between decoding and the device. ``HostBuffers`` gives CPU tensors (in a touched-once
``PackMemory`` when the program made one). For a CUDA device, chunks decode into a layer's staging in one bounded pool
of pinned host memory, reused for the life of the program (no pinned allocation per chunk or per pack); the layer's
copy to the GPU is issued on a copy stream of its own as soon as its last chunk is in, so copies run at link speed
while later layers still decode. A layer is handed to the model behind a fence: the model's stream waits for the
copies issued until then, never for the whole device.

``HostBuffers`` counts where it had to make do (``stats``; the worker's metrics export them): a staging request that
waited for a copy in flight to give a pool block back, staging the pool could not hold (a pinned allocation of its
own), and host tensors its ``PackMemory`` had no room for (ordinary pageable memory; in a CUDA worker's host cache,
memory the GPU copies from at pageable speed).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from packstore.packs.memory import PackMemory

STAGING_BYTES = 512 << 20  # the pinned pool: four layers of an 8B-shape model's 32k-token pack in flight
Fence = Callable[[], None]


def _no_wait() -> None:
    """The fence of copies that are already complete (or made on the consumer's own stream)."""


@runtime_checkable
class BufferProvider(Protocol):
    """Memory for decoded packs, and the copy from host staging to an accelerator. ``join_on_device``: chunks are
    staged as byte planes, copied as such and joined into elements on the device (``upload``), not on the CPU.
    ``decode_on_device``: chunks bound for a CUDA device are staged as stored, once checked, and decoded and joined on
    the device (``packstore.packs.device_decode``); elsewhere they decode as the other flag says."""

    join_on_device: bool
    decode_on_device: bool

    def layer_tensors(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device) -> list[torch.Tensor]:
        """``count`` new (uninitialised) tensors of ``shape`` and ``dtype`` on ``device``: one K or V per layer."""
        ...

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A host tensor a layer's K or V is decoded into before it is copied to ``device`` (not the CPU)."""
        ...

    def copy(self, staged: torch.Tensor, place: torch.Tensor) -> None:
        """Start copying ``staged`` into ``place`` on its device; the provider keeps ``staged`` until the copy is done."""
        ...

    def upload(self, staged: torch.Tensor, device: torch.device, then: Callable[[torch.Tensor], None]) -> None:
        """Copy ``staged`` (from ``staging``) to ``device`` and call ``then`` with the copy, where the work it starts
        is ordered after the copy and before the next ``fence``; the provider keeps ``staged`` until the copy is done."""
        ...

    def fence(self, device: torch.device) -> Fence:
        """A wait for every copy to ``device`` started so far: calling it (on the thread that will use the tensors)
        orders that thread's work after those copies, without blocking the host where the device allows."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Block until every copy started to ``device`` is done (a whole pack is handed out only after)."""
        ...


@dataclass(frozen=True)
class BufferStats:
    """What a ``HostBuffers`` had to make do with since it was made. ``pool_waits``: staging requests that blocked until
    a copy in flight gave a block of the pinned pool back, and ``pool_wait_seconds`` they blocked in all.
    ``pool_fallbacks``: staging served outside the pool, because the pool had no room and no copy in flight would
    give any back (a request larger than the pool, or every block held by layers still decoding): a pinned allocation
    of its own, paid per request; and their bytes. ``memory_fallbacks``: host tensors (a pack decoded to the CPU, or
    copied into the host cache) that the ``PackMemory`` had no room for, allocated in ordinary pageable memory
    instead (untouched pages; in a pinned region's place, a copy to the GPU at pageable speed), and their bytes."""

    pool_waits: int = 0
    pool_wait_seconds: float = 0.0
    pool_fallbacks: int = 0
    pool_fallback_bytes: int = 0
    memory_fallbacks: int = 0
    memory_fallback_bytes: int = 0


class HostBuffers:
    """CPU tensors from ``memory`` when it has room (else allocated as usual); CUDA tensors filled from a pinned
    staging pool of ``staging_bytes`` (made on first use) on one copy stream per device, with an event per copy so
    that a staging block is reused as soon as its own copy is done. Other accelerators copy from pageable memory on
    their current stream. ``join_on_device``: chunks' byte planes are staged and joined on the device
    (``packstore.packs.plane_join``), so the CPU threads only check and entropy-decode. ``decode_on_device``: chunks
    bound for a CUDA device are staged as stored (compressed), one block and one copy per layer, and entropy-decoded
    and joined there (``packstore.packs.device_decode``, numba-cuda: the ``gpu`` extra), so the CPU threads only check
    digests and read frame tables; packs bound for the CPU decode on the host whatever the flag. ``stats()``: the
    waits and fallbacks so far (``BufferStats``)."""

    def __init__(
        self,
        memory: PackMemory | None = None,
        *,
        staging_bytes: int = STAGING_BYTES,
        join_on_device: bool = False,
        decode_on_device: bool = False,
    ) -> None:
        self.memory = memory
        self.staging_bytes = staging_bytes
        self.join_on_device = join_on_device
        self.decode_on_device = decode_on_device
        self._pool: PackMemory | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()  # (copy done, its staging block)
        self._lock = threading.Lock()
        self._stats = BufferStats()

    def stats(self) -> BufferStats:
        """The pool waits and the fallbacks so far."""
        with self._lock:
            return self._stats

    def _count(self, **more: float) -> None:
        with self._lock:
            self._stats = BufferStats(**{name: value + more.get(name, 0) for name, value in vars(self._stats).items()})

    def layer_tensors(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device) -> list[torch.Tensor]:
        if device.type == "cuda":
            tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
            stream = self._stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the memory may have been in use there until now
            for tensor in tensors:
                tensor.record_stream(stream)  # freed early (a failed pack), it is reused only after the copies into it
            return tensors
        if device.type != "cpu" or self.memory is None or not count:
            return [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        each = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        block = self.memory.take(each * count)
        if block is None:
            self._count(memory_fallbacks=1, memory_fallback_bytes=each * count)
            return [torch.empty(shape, dtype=dtype) for _ in range(count)]
        return [block[i * each : (i + 1) * each].view(dtype).view(shape) for i in range(count)]

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return torch.empty(shape, dtype=dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        started, waited = time.perf_counter(), False
        try:
            while (block := self._staging_pool().take(nbytes)) is None:
                if not self._wait_for_oldest_copy():  # nothing in flight to wait for: no block will come back
                    self._count(pool_fallbacks=1, pool_fallback_bytes=nbytes)
                    return torch.empty(shape, dtype=dtype, pin_memory=True)
                waited = True
            return block.view(dtype).view(shape)
        finally:
            if waited:  # one wait per request, however many copies it waited for
                self._count(pool_waits=1, pool_wait_seconds=time.perf_counter() - started)

    def copy(self, staged: torch.Tensor, place: torch.Tensor) -> None:
        if place.device.type != "cuda":
            place.copy_(staged, non_blocking=True)  # torch keeps ``staged`` alive until the copy is done
            return
        stream = self._stream(place.device)
        with torch.cuda.stream(stream):
            place.copy_(staged, non_blocking=True)
        self._keep_until_copied(stream, staged)

    def upload(self, staged: torch.Tensor, device: torch.device, then: Callable[[torch.Tensor], None]) -> None:
        if device.type != "cuda":
            then(staged.to(device, non_blocking=True))  # on the CPU ``staged`` itself
            return
        stream = self._stream(device)
        with torch.cuda.stream(stream):  # the copy, and what ``then`` runs on it, in order on the copy stream
            then(staged.to(device, non_blocking=True))
        self._keep_until_copied(stream, staged)

    def _keep_until_copied(self, stream: torch.cuda.Stream, staged: torch.Tensor) -> None:
        """Hold ``staged`` until the work issued on ``stream`` so far is done; give back what has landed."""
        done = torch.cuda.Event()
        done.record(stream)
        with self._lock:
            self._in_flight.append((done, staged))
            while self._in_flight and self._in_flight[0][0].query():  # oldest first
                self._in_flight.popleft()

    def fence(self, device: torch.device) -> Fence:
        if device.type != "cuda":
            return _no_wait
        done = torch.cuda.Event()
        done.record(self._stream(device))
        return lambda: torch.cuda.current_stream(device).wait_event(done)

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record(self._stream(device))
            done.synchronize()  # this stream's copies only: the model's kernels run on
        elif device.type != "cpu":
            torch.accelerator.current_stream(device).synchronize()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of ``device`` (one per device, made on first use)."""
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]

    def _staging_pool(self) -> PackMemory:
        with self._lock:
            if self._pool is None:
                self._pool = PackMemory(self.staging_bytes, pinned=True)
            return self._pool

    def _wait_for_oldest_copy(self) -> bool:
        """Wait for the oldest copy in flight and give its staging block back; False when none is in flight."""
        with self._lock:
            if not self._in_flight:
                return False
            done, staged = self._in_flight.popleft()
        done.synchronize()
        del staged  # the block returns to the pool with its last view
        return True
