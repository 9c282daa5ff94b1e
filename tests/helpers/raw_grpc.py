"""gRPC calls written by hand on one HTTP/2 connection each: for headers a real gRPC client refuses to send, from a
local address of the caller's choosing (127.0.0.2, ...: another principal without tokens), and server streams
started and then left unread.

gRPC's own clients check metadata before it leaves (printable ASCII values, lowercase keys, 16 KiB); a hostile
peer need not. ``raw_unary`` sends whatever header bytes it is given (HPACK literals, no Huffman, no indexing;
CONTINUATION frames past 16 KiB) and a request message, and returns the response messages and how the stream
ended. It does not decode the response headers (that needs HPACK's Huffman table): a test learns the status the
service gave from the service's own metrics, and whether it answered from the messages. ``raw_stream`` starts a
server stream and stops reading after its first message, never opening the flow-control window.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
MAX_FRAME = 16384


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK's integer with an N-bit prefix (RFC 7541 §5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, neither string Huffman-coded (RFC 7541 §6.2.2)."""
    return b"\x00" + _integer(len(name), 7) + name + _integer(len(value), 7) + value


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


@dataclass
class RawReply:
    messages: list[bytes] = field(default_factory=list)  # the response messages, without gRPC's 5-byte prefix
    ended: str = ""  # "trailers", "reset" (RST_STREAM), "goaway", "closed" (the connection ended first)


def _header_block(address: str, path: str, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """A call's HEADERS block: gRPC's own fields for ``path``, then ``headers`` as given."""
    return b"".join(
        _literal(name, value)
        for name, value in [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", address.encode()),
            (b"content-type", b"application/grpc"), (b"te", b"trailers"), *headers,
        ]
    )


def _request(address: str, path: str, request: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The bytes of a whole call on a new connection: the preface, SETTINGS, the headers (after gRPC's own) and the
    request message, which ends the client's side of stream 1."""
    block = _header_block(address, path, headers)
    pieces = [block[i : i + MAX_FRAME] for i in range(0, len(block), MAX_FRAME)] or [b""]
    out = [PREFACE, _frame(SETTINGS, 0, 0)]
    for number, piece in enumerate(pieces):
        kind = HEADERS if number == 0 else CONTINUATION
        out.append(_frame(kind, END_HEADERS if number == len(pieces) - 1 else 0, 1, piece))
    out.append(_frame(DATA, END_STREAM, 1, b"\x00" + struct.pack(">I", len(request)) + request))
    return b"".join(out)


def _connect(address: str, timeout: float, source: str) -> socket.socket:
    """A TCP connection to ``address`` (host:port), from the local address ``source`` (empty: the system's choice)."""
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout, source_address=(source, 0) if source else None)


def _read(sock: socket.socket, path: str, deadline: float, reply: RawReply, enough: Callable[[int], bool]) -> None:
    """Read frames into ``reply`` (answering SETTINGS and PING) until stream 1 ends or ``enough(bytes of messages
    received)``; TimeoutError past ``deadline``."""
    buffer, body = bytearray(), bytearray()
    while not reply.ended and not enough(len(body)):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{path}: the stream did not end within its time")
        sock.settimeout(remaining)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            data = b""
        if not data:
            reply.ended = "closed"
            break
        buffer += data
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload, buffer = bytes(buffer[9 : 9 + length]), buffer[9 + length :]
            if kind == SETTINGS and not flags & ACK:
                sock.sendall(_frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                sock.sendall(_frame(PING, ACK, 0, payload))
            elif kind == GOAWAY and int.from_bytes(payload[:4], "big") & 0x7FFFFFFF < 1:  # our stream will not be processed
                reply.ended = reply.ended or "goaway"
            elif stream == 1 and kind == RST_STREAM:
                reply.ended = "reset"
            elif stream == 1 and kind == DATA:
                body += payload
            if stream == 1 and kind in (DATA, HEADERS) and flags & END_STREAM:
                reply.ended = "trailers"
    while len(body) >= 5 and len(body) >= 5 + int.from_bytes(body[1:5], "big"):
        size = int.from_bytes(body[1:5], "big")
        reply.messages.append(bytes(body[5 : 5 + size]))
        body = body[5 + size :]


def raw_unary(
    address: str, path: str, request: bytes, headers: list[tuple[bytes, bytes]], timeout: float = 10.0, source: str = ""
) -> RawReply:
    """Call ``path`` (e.g. /packstore.v1.PackStore/StatPack) at ``address`` (host:port, plaintext) with ``request`` (a
    serialized message) and ``headers`` sent as given, after gRPC's own, from the local address ``source``;
    TimeoutError when the stream has not ended within ``timeout`` seconds."""
    reply = RawReply()
    with _connect(address, timeout, source) as sock:
        try:
            sock.sendall(_request(address, path, request, headers))
        except OSError:  # the server may have answered and closed already
            pass
        _read(sock, path, time.monotonic() + timeout, reply, lambda received: False)
    return reply


class IdleStreams:
    """``count`` gRPC calls to ``path`` at ``address`` whose request never comes: HEADERS without END_STREAM, then
    nothing, with ``headers`` after gRPC's own, ``per_connection`` streams on each connection, from the local address
    ``source`` (another loopback address is another host to the server). The connections answer the server's SETTINGS and stay open until
    ``close``; how the server answered each stream is not read."""

    def __init__(
        self, address: str, path: str, count: int, *, headers: tuple[tuple[bytes, bytes], ...] = (), per_connection: int = 8,
        source: str = "127.0.0.1", timeout: float = 10.0,
    ) -> None:
        host, port = address.rsplit(":", 1)
        block = _header_block(address, path, headers)
        self.sockets: list[socket.socket] = []
        try:
            for first in range(0, count, per_connection):
                sock = socket.create_connection((host, int(port)), timeout=timeout, source_address=(source, 0))
                self.sockets.append(sock)
                streams = range(1, 2 * min(per_connection, count - first), 2)  # a client's streams are odd
                sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + b"".join(_frame(HEADERS, END_HEADERS, s, block) for s in streams))
                self._acknowledge_settings(sock)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _acknowledge_settings(sock: socket.socket) -> None:
        """Read the server's first frames until its SETTINGS, and acknowledge them (else it may drop the connection)."""
        buffer = bytearray()
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection before its SETTINGS")
            buffer += data
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                length, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                del buffer[: 9 + length]
                if kind == SETTINGS and not flags & ACK:
                    sock.sendall(_frame(SETTINGS, ACK, 0))
                    return

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()

    def __enter__(self) -> IdleStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

def raw_stream(
    address: str, path: str, request: bytes, headers: list[tuple[bytes, bytes]], timeout: float = 10.0, source: str = ""
) -> tuple[socket.socket | None, RawReply]:
    """Start the server stream ``path`` as ``raw_unary`` calls it and read no further than its first message: the
    connection, left open and unread, with the messages that came whole; or None when the stream ended first (the call
    was refused, or answered at once). The client never opens its flow-control window, so the server sends at most
    HTTP/2's initial 64 KiB and then waits: a stream held this way costs the caller nothing."""
    reply, sock = RawReply(), _connect(address, timeout, source)
    try:
        sock.sendall(_request(address, path, request, headers))
        _read(sock, path, time.monotonic() + timeout, reply, lambda received: received > 0)
    except BaseException:
        sock.close()
        raise
    if reply.ended:
        sock.close()
        return None, reply
    return sock, reply
