"""Hot packs: verified packs the service keeps in sealed shared-memory segments, one per pack, for the bulk port.

A segment holds one pack's stored chunks end to end in a memfd, written once from chunks that were verified
against their digests on the way in (read from the store, or uploaded), then sealed: nobody, the service
included, can write, grow or shrink it again. The bulk port sends a hot pack's chunks from it without reading
the store or hashing them again (the chunks crossed no hop since they were verified), and hands a client on
this host the segment itself over the local socket, so the bytes cross no socket at all. At most
``max_bytes`` are kept, the least recently used going first; a segment a transfer is still reading stays open
until that transfer is done (a client's own descriptor keeps its copy of the memory alive on its own).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

from packstore.errors import IntegrityError
from packstore.format import PackHeader

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE  # none can be lifted again


def chunk_offsets(header: PackHeader) -> tuple[int, ...]:
    """Where each chunk starts in a segment of the pack: stored end to end, in body order."""
    offsets, at = [], 0
    for chunk in header.chunks:
        offsets.append(at)
        at += chunk.stored_bytes
    return tuple(offsets)


class Segment:
    """One pack's chunks in a sealed memfd, mapped read-only for sending; ``fd`` is what a local client receives."""

    def __init__(self, fd: int, header: PackHeader) -> None:
        self.fd, self.header = fd, header
        self.offsets = chunk_offsets(header)
        self.size = sum(chunk.stored_bytes for chunk in header.chunks)
        self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if self.size else None
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")
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
        os.close(self.fd)


class SegmentWriter:
    """A pack's segment being written, each chunk once in any order; ``finish`` seals it."""

    def __init__(self, header: PackHeader) -> None:
        self.header = header
        self.offsets = chunk_offsets(header)
        self._fd = os.memfd_create(f"packstore-{header.content_hash[:16]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, sum(chunk.stored_bytes for chunk in header.chunks))
        self._written: set[int] = set()

    def add(self, index: int, data: bytes | memoryview) -> None:
        """Chunk ``index``'s stored bytes, already checked against its digest by the caller."""
        view, at = memoryview(data), self.offsets[index]
        if len(view) != self.header.chunks[index].stored_bytes:
            raise IntegrityError(f"pack {self.header.key}: chunk {index} has {len(view)} bytes, its header says {self.header.chunks[index].stored_bytes}")
        while view:
            written = os.pwrite(self._fd, view, at)
            view, at = view[written:], at + written
        self._written.add(index)

    def finish(self) -> Segment:
        """The sealed segment; ValueError unless every chunk was added."""
        if len(self._written) != len(self.header.chunks):
            raise ValueError(f"pack {self.header.key}: {len(self._written)} of {len(self.header.chunks)} chunks written")
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
        fd, self._fd = self._fd, -1
        return Segment(fd, self.header)

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HotPacks:
    """The service's hot packs: segments by the digest of their header (``pack_sha256``, which covers every chunk's
    digest, so a segment serves exactly the pack it was written for, in whichever namespace holds it), at most
    ``max_bytes`` of them (0: none are kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._segments: OrderedDict[str, Segment] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._segments)

    @contextmanager
    def lease(self, header: PackHeader) -> Iterator[Segment | None]:
        """The pack's segment, open until the context ends even if it is evicted meanwhile; None when not hot."""
        with self._lock:
            segment = self._segments.get(header.pack_sha256)
            if segment is not None:
                self._segments.move_to_end(header.pack_sha256)
                segment._users += 1
        try:
            yield segment
        finally:
            if segment is not None:
                with self._lock:
                    segment._users -= 1
                    if segment._evicted and not segment._users:
                        segment._close()

    def writer(self, header: PackHeader) -> SegmentWriter | None:
        """A writer for the pack's segment, or None when it could not be kept (too large, or none are kept)."""
        size = sum(chunk.stored_bytes for chunk in header.chunks)
        if not 0 < size <= self.max_bytes:
            return None
        return SegmentWriter(header)

    def add(self, writer: SegmentWriter) -> None:
        """Seal ``writer``'s segment and keep it, evicting the least recently used to stay within ``max_bytes``."""
        segment = writer.finish()
        with self._lock:
            old = self._segments.pop(segment.header.pack_sha256, None)
            if old is not None:
                self._drop(old)
            self._segments[segment.header.pack_sha256] = segment
            self._bytes += segment.size
            while self._bytes > self.max_bytes:
                self._drop(self._segments.popitem(last=False)[1])

    def evict(self, key: str) -> None:
        """Drop every segment of pack ``key`` (it was deleted)."""
        with self._lock:
            for digest in [d for d, s in self._segments.items() if s.header.key == key]:
                self._drop(self._segments.pop(digest))

    def clear(self) -> None:
        with self._lock:
            while self._segments:
                self._drop(self._segments.popitem()[1])

    def _drop(self, segment: Segment) -> None:
        """Forget ``segment`` (lock held); it closes now, or when its last lease ends."""
        self._bytes -= segment.size
        segment._evicted = True
        if not segment._users:
            segment._close()
