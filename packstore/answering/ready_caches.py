"""Where ready packs are kept: LRUs of decoded packs bounded in bytes, partitioned per namespace.

An ``Answerer`` keeps the packs it answers with in a device LRU (``ReadyCache`` on the model's device). A worker
may put a host cache under it (another ``ReadyCache``, of packs in host memory): a pack the device LRU evicted then
comes back with a copy to the device (``packs.tensors.start_copy``) instead of a read from the store. The host cache
takes each pack as it is fetched from the store (into the decoder's host buffers, or copied there once it arrived on
the device: ``to_host``), and every hit in the device LRU refreshes the
pack in the host cache too, so both order packs by the same last use: with a host cache at least as large as the
device LRU, a pack the device LRU evicts is still in the host cache (docs/architecture.md, "Threads and memory").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from packstore.packs.buffers import BufferProvider
from packstore.packs.tensors import Pack


def to_host(pack: Pack, buffers: BufferProvider) -> Pack:
    """``pack`` (on a device) copied into host memory from ``buffers`` (the worker's pinned host-cache memory), as the
    host cache keeps it; a pack already in host memory is itself."""
    if not pack.keys or pack.keys[0].device.type == "cpu":
        return pack
    shape, dtype, count = tuple(pack.keys[0].shape), pack.keys[0].dtype, len(pack.keys)
    tensors = buffers.layer_tensors(shape, dtype, 2 * count, torch.device("cpu"))
    for host, source in zip(tensors, [t for pair in zip(pack.keys, pack.values) for t in pair]):
        host.copy_(source)
    return Pack(header=pack.header, keys=tensors[0::2], values=tensors[1::2])


@dataclass
class PartitionCounts:
    """What one partition (namespace) holds in a ``ReadyCache``, and how often its packs were found there or evicted."""

    packs: int = 0
    bytes: int = 0
    hits: int = 0
    evictions: int = 0


class ReadyCache:
    """An LRU of ready packs (decoded tensors, on the device or, for a host cache, in host memory), bounded by their
    decoded KV bytes.

    Keys live in partitions (one per namespace on a worker, ``partition``; the cache's own methods use the
    unnamed one): a key of one partition never meets another's, while all share the one byte budget and LRU
    order. Packs, bytes, hits and evictions are counted per partition too (``stats_of``, ``counts``), so each
    tenant can be told its own. A single pack larger than the limit is returned but not kept. ``get`` loads a
    missing pack with ``load(key)``; concurrent misses on one key may load it twice, which is harmless. ``below``:
    the cache under this one (a host cache), where each hit here refreshes the same key as recently used.
    """

    def __init__(self, limit_bytes: int, *, below: ReadyCache | None = None) -> None:
        self.limit_bytes, self.below = limit_bytes, below
        self._packs: OrderedDict[tuple[str, str], Pack] = OrderedDict()  # by (partition, key), least recently used first
        self._bytes = 0
        self._counts: dict[str, PartitionCounts] = {}  # every partition that ever held or was asked for a pack
        self._lock = threading.Lock()

    def get(self, key: str, load: Callable[[str], Pack], partition: str = "") -> tuple[Pack, bool]:
        """The pack for ``key`` and whether it was already cached."""
        if (pack := self.peek(key, partition)) is not None:
            return pack, True
        pack = load(key)
        self.put(key, pack, partition)
        return pack, False

    def put(self, key: str, pack: Pack, partition: str = "") -> None:
        """Keep ``pack`` as ``key`` (unless one is kept already or it alone exceeds the limit), evicting the least recently used."""
        size = pack.header.raw_bytes
        with self._lock:
            if size <= self.limit_bytes and (partition, key) not in self._packs:
                self._packs[partition, key] = pack
                self._count(partition, 1, size)
                while self._bytes > self.limit_bytes:
                    (owner, _), evicted = self._packs.popitem(last=False)
                    self._count(owner, -1, -evicted.header.raw_bytes)
                    self._counts[owner].evictions += 1

    def _count(self, partition: str, packs: int, size: int) -> None:
        """(lock held) Add ``packs`` and ``size`` bytes to ``partition``'s usage and the total."""
        counts = self._counts.setdefault(partition, PartitionCounts())
        counts.packs += packs
        counts.bytes += size
        self._bytes += size

    def peek(self, key: str, partition: str = "") -> Pack | None:
        """The cached pack for ``key`` (marked recently used here and in ``below``, and counted as a hit), or None;
        never loads."""
        with self._lock:
            pack = self._packs.get((partition, key))
            if pack is None:
                return None
            self._packs.move_to_end((partition, key))
            self._counts[partition].hits += 1
        if self.below is not None:
            self.below.touch(key, partition)
        return pack

    def touch(self, key: str, partition: str = "") -> None:
        """Mark ``key`` recently used, if it is kept, without counting a hit (a hit in the cache above)."""
        with self._lock:
            if (partition, key) in self._packs:
                self._packs.move_to_end((partition, key))

    def keys(self) -> frozenset[tuple[str, str]]:
        """(partition, key) of every pack kept now."""
        with self._lock:
            return frozenset(self._packs)

    @property
    def stats(self) -> tuple[int, int]:
        """(packs cached, bytes cached), all partitions together."""
        with self._lock:
            return len(self._packs), self._bytes

    def stats_of(self, partition: str) -> tuple[int, int]:
        """(packs cached, bytes cached) of one partition."""
        with self._lock:
            counts = self._counts.get(partition, PartitionCounts())
            return counts.packs, counts.bytes

    def counts(self) -> dict[str, PartitionCounts]:
        """Every partition's counts as they are now (for a metrics scrape)."""
        with self._lock:
            return {partition: replace(counts) for partition, counts in self._counts.items()}

    def partition(self, name: str) -> ReadyPartition:
        """A view of this cache whose keys never meet another partition's (one per namespace)."""
        return ReadyPartition(self, name)


class ReadyPartition:
    """One namespace's share of a ReadyCache: the same bytes budget, keys and counts of its own, so a pack one
    tenant made ready is never a cache hit for another, and its ``stats`` tell only of its own packs."""

    def __init__(self, cache: ReadyCache, name: str) -> None:
        self.cache, self.name = cache, name

    def get(self, key: str, load: Callable[[str], Pack]) -> tuple[Pack, bool]:
        return self.cache.get(key, load, self.name)

    def peek(self, key: str) -> Pack | None:
        return self.cache.peek(key, self.name)

    def put(self, key: str, pack: Pack) -> None:
        self.cache.put(key, pack, self.name)

    @property
    def stats(self) -> tuple[int, int]:
        """(packs cached, bytes cached) of this partition only."""
        return self.cache.stats_of(self.name)
