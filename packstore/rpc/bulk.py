"""GetPack's bulk transfer: a pack's chunks on a plain TCP (or TLS) connection beside the gRPC port, or on a
local socket when client and service share a host.

gRPC's Python stream costs more per byte than the rest of a fetch together (HTTP/2 framing, a copy out of
each message, a thread hand-off per message). A GetPack that asks for ``bulk`` gets a single-use ticket
instead of the chunks; the client presents it on the bulk port and reads each chunk straight into a
buffer of its own. On the local socket a pack the service holds hot arrives as one sealed shared-memory
segment instead (a file descriptor and a table of where each chunk is), which the client maps: its bytes
cross no socket. protocol.md ("Bulk transfer") is the specification; this module holds both ends'
framing and the client's reader.

    client -> server   MAGIC, ticket (TICKET_BYTES)
    server -> client   frames: FRAME (kind, index, length), then ``length`` bytes
                       CHUNK (index, stored bytes), ..., END; or (local socket) SEGMENT (a descriptor, and
                       where each chunk lies in it), END; or ERROR (a JSON error) instead
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import ssl
import struct
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np

from packstore.errors import ERROR_CLASSES, IntegrityError, InvalidInput, PackstoreError, Unavailable
from packstore.format import PackHeader

MAGIC = b"PKB1"
TICKET_BYTES = 32
FRAME = struct.Struct("<BIQ")  # kind, chunk index (0 for END and ERROR; the entry count for SEGMENT), length of what follows
CHUNK, END, ERROR, SEGMENT = 1, 2, 3, 4
SEGMENT_ENTRY = struct.Struct("<IQQ")  # chunk index, where its stored bytes start in the segment, their length
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE  # a segment's bytes can neither change nor vanish under the reader
MAX_ERROR_BYTES = 64 << 10
STALL_SECONDS = 120.0  # a bulk read that receives nothing for this long fails (unless the client set a timeout)


def chunk_frame(index: int, length: int) -> bytes:
    return FRAME.pack(CHUNK, index, length)


def end_frame() -> bytes:
    return FRAME.pack(END, 0, 0)


def segment_frame(entries: Sequence[tuple[int, int, int]]) -> bytes:
    """A SEGMENT frame and its table: (chunk index, offset in the segment, stored length) per chunk, in order. It
    travels with the segment's descriptor (SCM_RIGHTS) on a local socket."""
    return FRAME.pack(SEGMENT, len(entries), SEGMENT_ENTRY.size * len(entries)) + b"".join(SEGMENT_ENTRY.pack(*e) for e in entries)


def error_frame(error: PackstoreError) -> bytes:
    """An ERROR frame carrying the error as gRPC's rich status does: its code, message and fields."""
    body = json.dumps({"code": error.code, "message": str(error), "fields": error.fields}).encode()[:MAX_ERROR_BYTES]
    return FRAME.pack(ERROR, 0, len(body)) + body


def error_from_frame(body: bytes) -> PackstoreError:
    """The packstore error an ERROR frame carries (the same class and fields as raised on the server)."""
    try:
        found = json.loads(bytes(body))
        return ERROR_CLASSES.get(found["code"], PackstoreError).from_fields(found["message"], dict(found["fields"]))
    except (ValueError, KeyError, TypeError):
        return PackstoreError(f"the bulk transfer failed with an unreadable error: {bytes(body[:200])!r}")


def recv_exact(sock: socket.socket, size: int, into: memoryview | None = None) -> memoryview:
    """Exactly ``size`` bytes from ``sock``, into ``into`` (a view of that size) or a fresh buffer (not zero-filled
    first); EOFError when the peer closes before they have all come."""
    view = memoryview(np.empty(size, np.uint8)).cast("B") if into is None else into
    got = 0
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if not count:
            raise EOFError(f"the connection closed after {got} of {size} bytes")
        got += count
    return view


class ReceiveBuffers:
    """Receive buffers one client keeps for reuse, at most ``keep_bytes`` of them idle. A fetch leases one big
    enough for all its chunks and gives it back once every chunk is decoded: its pages are then touched once,
    not on every fetch (faulting in fresh pages costs about as much CPU as the transfer itself)."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, size: int) -> Iterator[memoryview]:
        """A buffer of ``size`` bytes, this lease's alone until the context ends."""
        with self._lock:  # idle buffers are kept smallest first: take the first that fits (by position: == on arrays compares bytes)
            fits = next((i for i, b in enumerate(self._idle) if b.nbytes >= size), None)
            buffer = self._idle.pop(fits) if fits is not None else np.empty(size, np.uint8)
        try:
            yield memoryview(buffer)[:size]
        finally:
            with self._lock:
                self._idle.append(buffer)
                self._idle.sort(key=lambda b: b.nbytes)
                idle = sum(b.nbytes for b in self._idle)
                while idle > self.keep_bytes:
                    idle -= self._idle.pop().nbytes  # the largest goes first

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._idle)


def read_frame(sock: socket.socket) -> tuple[int, int, int]:
    """The next frame's (kind, index, length)."""
    return FRAME.unpack(recv_exact(sock, FRAME.size))


def _read_frame_and_descriptor(sock: socket.socket) -> tuple[tuple[int, int, int], int | None]:
    """The next frame from a local socket, and the descriptor that came with its first bytes (None if none did)."""
    data, fds, flags, _ = socket.recv_fds(sock, FRAME.size, 1)
    descriptor = fds[0] if fds else None
    try:
        if flags & socket.MSG_CTRUNC:
            raise InvalidInput("the bulk transfer sent more descriptors than one")
        if not data:
            raise EOFError("the connection closed between frames")
        frame = FRAME.unpack(bytes(data) + bytes(recv_exact(sock, FRAME.size - len(data)))) if len(data) < FRAME.size else FRAME.unpack(data)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return frame, descriptor


def _next_frame(sock: socket.socket, mappings: "Mappings | None" = None) -> tuple[int, int, int, int | None]:
    """The next frame's (kind, index, length, descriptor), raising the error an ERROR frame carries. Descriptors
    come only on local sockets (``mappings`` given), and only with a SEGMENT frame."""
    if mappings is None:
        (kind, index, length), descriptor = read_frame(sock), None
    else:
        (kind, index, length), descriptor = _read_frame_and_descriptor(sock)
    if descriptor is not None and kind != SEGMENT:
        os.close(descriptor)
        raise InvalidInput(f"the bulk transfer sent a descriptor with a frame of kind {kind}")
    if kind == ERROR:
        raise error_from_frame(recv_exact(sock, min(length, MAX_ERROR_BYTES)))
    return kind, index, length, descriptor


def _opened(sock: socket.socket, setup: Callable[[socket.socket], socket.socket], ticket: bytes, timeout: float | None) -> socket.socket:
    """``setup(sock)`` (the socket to use: ``sock`` or a wrapper of it), with ``ticket`` presented on it under the
    transfer's timeout; whatever fails closes it."""
    try:
        sock = setup(sock)
        sock.settimeout(timeout or STALL_SECONDS)
        sock.sendall(MAGIC + ticket)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(host: str, port: int, ticket: bytes, *, timeout: float | None, tls: ssl.SSLContext | None) -> socket.socket:
    """A connection to the bulk port with ``ticket`` presented (OSError when it cannot be opened)."""
    host = host.strip("[]")  # an IPv6 address as written in a target

    def setup(sock: socket.socket) -> socket.socket:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock if tls is None else tls.wrap_socket(sock, server_hostname=host)

    return _opened(socket.create_connection((host, port), timeout=min(timeout or 10.0, 10.0)), setup, ticket, timeout)


def connect_local(name: str, ticket: bytes, *, timeout: float | None) -> socket.socket:
    """A connection to the service's local bulk socket (the abstract unix socket ``name``) with ``ticket`` presented;
    OSError when there is none on this host (the service runs elsewhere, or in another network namespace)."""

    def setup(sock: socket.socket) -> socket.socket:
        sock.settimeout(min(timeout or 10.0, 10.0))
        sock.connect("\0" + name)
        return sock

    return _opened(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), setup, ticket, timeout)


class Mappings:
    """The segments one transfer mapped; unmapped when the context ends (once every chunk read from them is
    decoded). A segment is refused unless it is sealed against writing and shrinking and holds its table."""

    def __init__(self) -> None:
        self._maps: list[tuple[mmap.mmap, memoryview]] = []

    def map(self, descriptor: int, end: int) -> memoryview:
        """The segment ``descriptor`` (closed here: the mapping keeps the memory) mapped read-only, at least ``end`` bytes."""
        try:
            seals, size = fcntl.fcntl(descriptor, fcntl.F_GET_SEALS), os.fstat(descriptor).st_size
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise IntegrityError("the bulk transfer sent a segment that is not sealed against writes and shrinking")
            if size < end:
                raise IntegrityError(f"the bulk transfer sent a segment of {size} bytes whose table reaches byte {end}")
            if not size:
                return memoryview(b"")
            mapped = mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:  # not a memfd, say: F_GET_SEALS fails
            raise IntegrityError(f"the bulk transfer sent a descriptor that is not a sealed segment: {exc}") from None
        finally:
            os.close(descriptor)
        view = memoryview(mapped)
        self._maps.append((mapped, view))
        return view

    def __enter__(self) -> "Mappings":
        return self

    def __exit__(self, *exc: object) -> None:
        for mapped, view in self._maps:
            view.release()
            try:
                mapped.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes when that does
                pass
        self._maps.clear()


def bulk_chunks(
    sock: socket.socket, header: PackHeader, indices: Sequence[int], peer: str, buffer: memoryview | None = None, mappings: Mappings | None = None
) -> Iterator[tuple[int, memoryview]]:
    """Read the chunks ``indices`` of ``header``'s pack from a bulk connection, in order, as (index, bytes), each
    into its place in ``buffer`` (their stored sizes end to end) or, without one, a buffer of its own; on a local
    socket (``mappings`` given) they may come as one segment, mapped into ``mappings`` instead. Raises the server's
    error from an ERROR frame, and Unavailable when the connection breaks off. The connection is closed when the
    chunks are done or the reader stops."""
    received, offset = 0, 0
    try:
        kind, index, length, descriptor = _next_frame(sock, mappings)
        if kind == SEGMENT and mappings is not None:
            for found in _segment_chunks(sock, header, indices, index, length, descriptor, mappings):
                yield found
                received += 1
            kind, index, length, descriptor = _next_frame(sock, mappings)
        for expected in indices[received:]:
            if kind != CHUNK or index != expected or length != header.chunks[expected].stored_bytes:
                raise InvalidInput(
                    f"pack {header.key}: the bulk transfer sent frame {kind} for chunk {index} of {length} bytes where chunk "
                    f"{expected} of {header.chunks[expected].stored_bytes} bytes was expected"
                )
            into = None if buffer is None else buffer[offset : offset + length]
            yield index, recv_exact(sock, length, into)
            received, offset = received + 1, offset + length
            kind, index, length, descriptor = _next_frame(sock, mappings)
        if kind != END:
            raise InvalidInput(f"pack {header.key}: the bulk transfer went on after the {len(indices)} chunks asked for")
    except (OSError, EOFError) as exc:
        raise Unavailable(f"{peer}: the bulk transfer of pack {header.key} broke off after {received} of {len(indices)} chunks: {exc}") from None
    finally:
        sock.close()


def _segment_chunks(
    sock: socket.socket, header: PackHeader, indices: Sequence[int], count: int, length: int, descriptor: int | None, mappings: Mappings
) -> Iterator[tuple[int, memoryview]]:
    """The chunks of a SEGMENT frame: its table read and checked against the chunks asked for, then the segment mapped."""
    if descriptor is None:
        raise InvalidInput(f"pack {header.key}: the bulk transfer sent a segment without its descriptor")
    try:
        if count != len(indices) or length != SEGMENT_ENTRY.size * count:
            raise InvalidInput(f"pack {header.key}: the bulk transfer's segment lists {count} chunks where {len(indices)} were asked for")
        table = list(SEGMENT_ENTRY.iter_unpack(recv_exact(sock, length))) if length else []
        for (index, start, size), expected in zip(table, indices):
            if index != expected or size != header.chunks[expected].stored_bytes:
                raise InvalidInput(f"pack {header.key}: the bulk transfer's segment holds chunk {index} of {size} bytes where chunk {expected} was expected")
        owned, descriptor = descriptor, None  # map() closes it, whatever happens
        segment = mappings.map(owned, max((start + size for _, start, size in table), default=0))
    finally:
        if descriptor is not None:
            os.close(descriptor)
    for index, start, size in table:
        yield index, segment[start : start + size]
