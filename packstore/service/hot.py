"""Hot packs: verified packs the service keeps in its own memory, one buffer per pack and namespace, for the bulk port.

A hot pack holds one pack's stored chunks end to end, written once from chunks that were verified against their
digests on the way in (read from the store, or uploaded). The bulk port sends a hot pack's chunks from it without
reading the store or hashing them again (the chunks crossed no hop since they were verified).

Tenants share nothing here: a hot pack is keyed by its namespace and its header's digest, so a pack one namespace
holds is never a hit for another, even for the same content, and deleting it in one namespace touches no other.
Each namespace has a budget of its own: packs kept, packs being written (an upload or a whole-pack read in flight)
and packs evicted while a transfer still sends them all count against their namespace's ``max_bytes`` until their
memory is unmapped, and a pack is only ever evicted to make room in its own namespace. So nothing one tenant reads or
uploads changes which of another tenant's packs are hot, or anything that tenant can see (its metrics, its read
times from hot copies); the service's memory is bounded by ``max_bytes`` times the namespaces in use. The memory is
private anonymous memory (counted as the process's ``RssAnon``). No buffer ever leaves the process (clients receive
copies of the bytes), so nothing a client does can keep one alive.
"""

from __future__ import annotations

import mmap
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from packstore.errors import IntegrityError
from packstore.format import PackHeader
from packstore.format.chunks import Buffer


def chunk_offsets(header: PackHeader) -> tuple[int, ...]:
    """Where each chunk starts in a hot pack's buffer: stored end to end, in body order."""
    offsets, at = [], 0
    for chunk in header.chunks:
        offsets.append(at)
        at += chunk.stored_bytes
    return tuple(offsets)


def stored_size(header: PackHeader) -> int:
    return sum(chunk.stored_bytes for chunk in header.chunks)


class Segment:
    """One pack's chunks in an anonymous mapping of its own (unmapped as a whole when dropped), written by a
    ``SegmentWriter`` and read-only from then on."""

    def __init__(self, namespace: str, header: PackHeader, memory: mmap.mmap | None) -> None:
        self.namespace, self.header = namespace, header
        self.offsets = chunk_offsets(header)
        self.size = stored_size(header)
        self._map = memory
        self.view = memoryview(memory).toreadonly() if memory is not None else memoryview(b"")
        self._users, self._evicted = 0, False

    def chunk(self, index: int) -> memoryview:
        start = self.offsets[index]
        return self.view[start : start + self.header.chunks[index].stored_bytes]

    def _close(self) -> None:
        self.view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view of a chunk is still alive somewhere: the mapping goes when that does
                pass


class SegmentWriter:
    """A pack's hot copy being written, each chunk once in any order, within bytes its ``HotPacks`` reserved for it."""

    def __init__(self, owner: HotPacks, namespace: str, header: PackHeader) -> None:
        self.owner, self.namespace, self.header = owner, namespace, header
        self.offsets = chunk_offsets(header)
        self.size = stored_size(header)
        self._map: mmap.mmap | None = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE)  # anonymous: RssAnon, not shared memory
        self._written: set[int] = set()

    def add(self, index: int, data: Buffer) -> None:
        """Chunk ``index``'s stored bytes, already checked against its digest by the caller."""
        if self._map is None:
            raise ValueError(f"pack {self.header.key}: its hot copy was already finished or discarded")
        view, at = memoryview(data), self.offsets[index]
        if len(view) != self.header.chunks[index].stored_bytes:
            raise IntegrityError(
                f"pack {self.header.key}: chunk {index} has {len(view)} bytes, its header says {self.header.chunks[index].stored_bytes}"
            )
        self._map[at : at + len(view)] = view
        self._written.add(index)

    def finish(self) -> Segment:
        """The finished hot pack; ValueError unless every chunk was added."""
        if len(self._written) != len(self.header.chunks) or self._map is None:
            raise ValueError(f"pack {self.header.key}: {len(self._written)} of {len(self.header.chunks)} chunks written")
        memory, self._map = self._map, None
        return Segment(self.namespace, self.header, memory)

    def discard(self) -> None:
        """Give the memory and its reservation back (an upload that failed, a transfer cut short)."""
        if self._map is not None:
            self._map.close()
            self._map = None
            self.owner._release(self.namespace, self.size)


class HotPacks:
    """The service's hot packs, by (namespace, header digest), at most ``max_bytes`` of memory per namespace (0: none
    kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._segments: OrderedDict[tuple[str, str], Segment] = OrderedDict()  # least recently used first
        self._bytes: Counter[str] = Counter()  # per namespace, memory mapped: kept, being written, or evicted but still sent
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """Memory the hot packs of every namespace hold now (at most ``max_bytes`` each)."""
        with self._lock:
            return sum(self._bytes.values())

    def namespace_bytes(self, namespace: str) -> int:
        """Memory ``namespace``'s hot packs hold now, counted against its ``max_bytes``."""
        with self._lock:
            return self._bytes[namespace]

    def __len__(self) -> int:
        return len(self._segments)

    def stats_by_namespace(self) -> dict[str, tuple[int, int]]:
        """Per namespace, (hot packs, their stored bytes)."""
        found: dict[str, tuple[int, int]] = {}
        with self._lock:
            for segment in self._segments.values():
                packs, size = found.get(segment.namespace, (0, 0))
                found[segment.namespace] = (packs + 1, size + segment.size)
        return found

    @contextmanager
    def lease(self, namespace: str, header: PackHeader) -> Iterator[Segment | None]:
        """The namespace's hot copy of the pack, kept until the context ends even if evicted meanwhile; None when not hot."""
        key = (namespace, header.pack_sha256)
        with self._lock:
            segment = self._segments.get(key)
            if segment is not None:
                self._segments.move_to_end(key)
                segment._users += 1
        try:
            yield segment
        finally:
            if segment is not None:
                with self._lock:
                    segment._users -= 1
                    if segment._evicted and not segment._users:
                        self._unmap(segment)

    def writer(self, namespace: str, header: PackHeader) -> SegmentWriter | None:
        """A writer for the namespace's hot copy of the pack, its memory reserved now (evicting the namespace's least
        recently used packs to make room, never another namespace's); None when it cannot be kept (larger than
        ``max_bytes``, or the namespace's room is taken by its writes and transfers in flight)."""
        size = stored_size(header)
        if not 0 < size <= self.max_bytes:
            return None
        with self._lock:
            mine = [key for key in self._segments if key[0] == namespace]  # least recently used first
            while self._bytes[namespace] + size > self.max_bytes and mine:
                self._drop(self._segments.pop(mine.pop(0)))
            if self._bytes[namespace] + size > self.max_bytes:
                return None
            self._bytes[namespace] += size
        try:
            return SegmentWriter(self, namespace, header)
        except BaseException:
            self._release(namespace, size)
            raise

    def add(self, writer: SegmentWriter) -> None:
        """Keep ``writer``'s finished hot pack (its memory was reserved when the writer was made)."""
        segment = writer.finish()
        with self._lock:
            key = (segment.namespace, segment.header.pack_sha256)
            old = self._segments.pop(key, None)
            if old is not None:
                self._drop(old)
            self._segments[key] = segment

    def evict(self, namespace: str, key: str) -> None:
        """Drop the namespace's hot copies of pack ``key`` (it was deleted there); other namespaces keep theirs."""
        with self._lock:
            for found in [k for k, s in self._segments.items() if k[0] == namespace and s.header.key == key]:
                self._drop(self._segments.pop(found))

    def _drop(self, segment: Segment) -> None:
        """Forget ``segment`` (lock held); its memory goes now, or when its last lease ends."""
        segment._evicted = True
        if not segment._users:
            self._unmap(segment)

    def _unmap(self, segment: Segment) -> None:
        """(lock held)"""
        segment._close()
        self._bytes[segment.namespace] -= segment.size

    def _release(self, namespace: str, size: int) -> None:
        with self._lock:
            self._bytes[namespace] -= size
