"""The client's reader of GetPack's bulk transfer (the frames are ``rpc/frames.py``): gRPC's Python stream costs more
per byte than the rest of a fetch together (HTTP/2 framing, a copy out of each message, a thread hand-off per
message), so a GetPack that asks for ``bulk`` gets a single-use ticket instead of the chunks; the client presents it
on the bulk port and reads each chunk straight into a buffer of its own."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from packstore.errors import InvalidInput, Unavailable
from packstore.format import PackHeader
from packstore.rpc.frames import CHUNK, END, MAGIC, next_frame, recv_exact

START_SECONDS = 10.0  # a transfer whose first frame takes longer is given up: the client streams the pack instead
STALL_SECONDS = 120.0  # a bulk read that receives nothing for this long fails (unless the client set a timeout)


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
            yield buffer.data[:size]
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


def first_frame(sock: socket.socket, timeout: float | None) -> tuple[int, int, int]:
    """The transfer's first frame, awaited at most START_SECONDS (a server that admits a transfer answers at once);
    the socket is left with the transfer's own timeout. Raises the error an ERROR frame carries, OSError (a timeout, a
    reset) or EOFError (closed unanswered) otherwise; the caller closes the socket then."""
    sock.settimeout(min(timeout or START_SECONDS, START_SECONDS))
    frame = next_frame(sock)
    sock.settimeout(timeout or STALL_SECONDS)
    return frame


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


def bulk_chunks(
    sock: socket.socket,
    header: PackHeader,
    indices: Sequence[int],
    peer: str,
    buffer: memoryview | None = None,
    first: tuple[int, int, int] | None = None,
) -> Iterator[tuple[int, memoryview]]:
    """Read the chunks ``indices`` of ``header``'s pack from a bulk connection, in order, as (index, bytes), each
    into its place in ``buffer`` (their stored sizes end to end) or, without one, a buffer of its own; ``first``: the
    first frame when the caller already read it (``start_transfer``). Raises the server's error from an ERROR frame,
    and Unavailable when the connection breaks off. The connection is closed when the chunks are done or the
    reader stops."""
    received, offset = 0, 0
    try:
        kind, index, length = first if first is not None else next_frame(sock)
        for expected in indices:
            if kind != CHUNK or index != expected or length != header.chunks[expected].stored_bytes:
                raise InvalidInput(
                    f"pack {header.key}: the bulk transfer sent frame {kind} for chunk {index} of {length} bytes where chunk "
                    f"{expected} of {header.chunks[expected].stored_bytes} bytes was expected"
                )
            into = None if buffer is None else buffer[offset : offset + length]
            yield index, recv_exact(sock, length, into)
            received, offset = received + 1, offset + length
            kind, index, length = next_frame(sock)
        if kind != END:
            raise InvalidInput(f"pack {header.key}: the bulk transfer went on after the {len(indices)} chunks asked for")
    except (OSError, EOFError) as exc:
        raise Unavailable(
            f"{peer}: the bulk transfer of pack {header.key} broke off after {received} of {len(indices)} chunks: {exc}"
        ) from None
    finally:
        sock.close()
