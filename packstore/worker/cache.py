"""An LRU of ready packs (tensors already on the device), bounded by their decoded KV bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from packstore.format import Pack


class PackCache:
    """Keeps the most recently used packs whose K/V bytes fit in ``limit_bytes``.

    A single pack larger than the limit is returned but not kept. ``get`` loads a missing pack
    with ``load(key)``; concurrent misses on one key may load it twice, which is harmless.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._packs: OrderedDict[str, Pack] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str, load: Callable[[str], Pack]) -> tuple[Pack, bool]:
        """The pack for ``key`` and whether it was already cached."""
        with self._lock:
            if key in self._packs:
                self._packs.move_to_end(key)
                return self._packs[key], True
        pack = load(key)
        size = pack.header.raw_bytes
        with self._lock:
            if size <= self.limit_bytes and key not in self._packs:
                self._packs[key] = pack
                self._bytes += size
                while self._bytes > self.limit_bytes:
                    _, evicted = self._packs.popitem(last=False)
                    self._bytes -= evicted.header.raw_bytes
        return pack, False

    @property
    def stats(self) -> tuple[int, int]:
        """(packs cached, bytes cached)."""
        with self._lock:
            return len(self._packs), self._bytes
