"""The decoder a program builds once at its entry point: the thread pool chunks are coded in, and the buffer
provider decoded tensors are made in. Nothing of it exists before the program makes one (no pool at import)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from packstore.packs.buffers import BufferProvider, HostBuffers

# zstd, blake3 and the codec's compiled kernels release the GIL, so chunks are coded in parallel threads whose
# scratch stays warm between packs (packstore.format.codec): one thread per core this process may run on (a 16-core
# GPU host builds on 16). At most MAX_WORKERS: each thread keeps scratch of a few chunks' size, and a pack has few
# more chunks than that in flight (a layer's token blocks), so more threads would add memory, not speed.
MAX_WORKERS = 32
WORKERS = max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
T = TypeVar("T")


class Decoder:
    """Chunk coding threads (``workers``, started on first use) and the ``buffers`` packs are decoded into.

    A forked child gets a fresh pool on its first use (it has none of its parent's threads). ``close`` (or leaving
    a ``with`` block) stops the threads once the work submitted is done."""

    def __init__(self, workers: int = WORKERS, buffers: BufferProvider | None = None) -> None:
        self.workers = workers
        self.buffers: BufferProvider = buffers if buffers is not None else HostBuffers()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is not None and self._pid == os.getpid():
            return pool  # the common case, on every chunk: no lock
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool, self._pid = ThreadPoolExecutor(self.workers, thread_name_prefix="packstore-chunks"), os.getpid()
            return self._pool

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a chunk thread."""
        return self._executor().submit(fn, *args, **kwargs)

    def map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """``fn`` of each item, in parallel, in order."""
        return list(self._executor().map(fn, items))

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
