"""The bulk port's frames, both ends' half of GetPack's bulk transfer (protocol.md, "Bulk transfer"): a pack's
chunks on a plain TCP (or TLS) connection beside the gRPC port, or on a local unix socket when client and service
share a host. The service's side is ``service/bulk.py``; the client's reader is ``store/remote/bulk_reads.py``.

    client -> server   MAGIC, ticket (TICKET_BYTES), within HELLO_SECONDS of connecting
    server -> client   frames: FRAME (kind, index, length), then ``length`` bytes
                       CHUNK (index, stored bytes), ..., END; or ERROR (a JSON error) instead
"""

from __future__ import annotations

import json
import socket
import struct

import numpy as np

from packstore.errors import ERROR_CLASSES, PackstoreError

MAGIC = b"PKB1"
TICKET_BYTES = 32
HELLO = len(MAGIC) + TICKET_BYTES
FRAME = struct.Struct("<BIQ")  # kind, chunk index (0 for END and ERROR), length of what follows
CHUNK, END, ERROR = 1, 2, 3  # (4 was SEGMENT, a shared-memory segment on the local socket; retired, never sent)
HELLO_SECONDS = 1.0  # a connection must finish any TLS handshake and present its ticket within this, or it is closed
MAX_ERROR_BYTES = 64 << 10


def chunk_frame(index: int, length: int) -> bytes:
    return FRAME.pack(CHUNK, index, length)


def end_frame() -> bytes:
    return FRAME.pack(END, 0, 0)


def error_frame(error: PackstoreError) -> bytes:
    """An ERROR frame carrying the error as gRPC's rich status does: its code, message and fields."""
    body = json.dumps({"code": error.code, "message": str(error), "fields": error.fields}).encode()[:MAX_ERROR_BYTES]
    return FRAME.pack(ERROR, 0, len(body)) + body


def error_from_frame(body: bytes | memoryview) -> PackstoreError:
    """The packstore error an ERROR frame carries (the same class and fields as raised on the server)."""
    try:
        found = json.loads(bytes(body))
        return ERROR_CLASSES.get(found["code"], PackstoreError).from_fields(found["message"], dict(found["fields"]))
    except (ValueError, KeyError, TypeError, RecursionError):  # (JSON nested too deep for the parser)
        return PackstoreError(f"the bulk transfer failed with an unreadable error: {bytes(body[:200])!r}")


def recv_exact(sock: socket.socket, size: int, into: memoryview | None = None) -> memoryview:
    """Exactly ``size`` bytes from ``sock``, into ``into`` (a view of that size) or a fresh buffer (not zero-filled
    first); EOFError when the peer closes before they have all come."""
    view = np.empty(size, np.uint8).data.cast("B") if into is None else into
    got = 0
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if not count:
            raise EOFError(f"the connection closed after {got} of {size} bytes")
        got += count
    return view


def read_frame(sock: socket.socket) -> tuple[int, int, int]:
    """The next frame's (kind, index, length)."""
    return FRAME.unpack(recv_exact(sock, FRAME.size))


def next_frame(sock: socket.socket) -> tuple[int, int, int]:
    """The next frame's (kind, index, length), raising the error an ERROR frame carries."""
    kind, index, length = read_frame(sock)
    if kind == ERROR:
        raise error_from_frame(recv_exact(sock, min(length, MAX_ERROR_BYTES)))
    return kind, index, length


