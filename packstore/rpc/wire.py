"""GetPack's chunk messages in protobuf's wire format, written and read here rather than by protobuf.

A chunk is most of what GetPack carries. Through protobuf its bytes were copied four times on the server
(out of the store, into a Chunk, into a GetPackResponse, serialized) and twice on the client (parsed, then
read from the field). Written by hand, a response is one join of the chunk with a few bytes of framing; read
by hand, a piece's data is a view of the received message. The bytes on the wire are the same (a test checks
them against protobuf both ways), so any gRPC client of ``packstore.v1`` reads them as before. Uploads send
chunks as ordinary Chunk messages (``chunk_pieces``); ``ChunkAssembler`` joins pieces back into chunks on either end.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from packstore.errors import InvalidInput
from packstore.v1 import store_pb2

if TYPE_CHECKING:
    from packstore.format.chunks import Buffer
    from packstore.format.header import PackHeader

PIECE_BYTES = 1 << 20  # chunks travel in pieces of at most 1 MiB, whatever the message-size limits
GET_PACK = "/packstore.v1.PackStore/GetPack"

_VARINT, _LEN = 0, 2
_FIXED = {1: 8, 5: 4}  # wire types of fixed width, skipped as unknown fields


def piece_views(data: Buffer) -> Iterator[memoryview]:
    """``data`` in consecutive views of at most PIECE_BYTES (one, even when empty)."""
    view = memoryview(data)
    for start in range(0, max(len(view), 1), PIECE_BYTES):
        yield view[start : start + PIECE_BYTES]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_responses(index: int, data: Buffer, digest: str) -> Iterator[bytes]:
    """A chunk as serialized GetPackResponse messages (``chunk`` set), one per piece, each made as it is sent;
    byte for byte what protobuf writes for the same messages."""
    index_field = b"\x08" + _varint(index) if index else b""  # proto3 leaves out fields at their default
    encoded_digest = digest.encode()
    digest_field = b"\x1a" + _varint(len(encoded_digest)) + encoded_digest if encoded_digest else b""
    for piece in piece_views(data):
        data_field = b"\x12" + _varint(len(piece)) if len(piece) else b""
        inner = len(index_field) + len(data_field) + len(piece) + len(digest_field)
        yield b"".join((b"\x12", _varint(inner), index_field, data_field, piece, digest_field))


def serialize_get_pack_response(response: bytes | store_pb2.GetPackResponse) -> bytes:
    """GetPack's response serializer: a chunk response comes already serialized (``chunk_responses``)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


@dataclass(frozen=True)
class ChunkPiece:
    """One piece of a chunk as GetPack sent it; ``data`` is a view of the received message."""

    index: int
    data: memoryview
    digest: str


class _Reader:
    """Reads protobuf wire fields from a buffer, refusing what runs past its end."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.at = view, 0

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            if self.at >= len(self.view) or shift > 63:
                raise ValueError("truncated or overlong varint")
            byte = self.view[self.at]
            self.at += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    def fields(self) -> Iterator[tuple[int, int, int | memoryview]]:
        """(field number, wire type, value): a varint, or a view of a length-delimited field; others skipped."""
        while self.at < len(self.view):
            key = self.varint()
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                yield number, wire_type, self.varint()
            elif wire_type == _LEN:
                length = self.varint()
                if length > len(self.view) - self.at:
                    raise ValueError(f"field {number} runs past the end of the message")
                self.at += length
                yield number, wire_type, self.view[self.at - length : self.at]
            elif wire_type in _FIXED:
                self.at += _FIXED[wire_type]
                if self.at > len(self.view):
                    raise ValueError(f"field {number} runs past the end of the message")
            else:
                raise ValueError(f"field {number} has wire type {wire_type}, which GetPack does not use")


def parse_get_pack_response(message: bytes) -> store_pb2.GetPackResponse | ChunkPiece:
    """GetPack's response deserializer: a chunk piece read by hand (its data not copied), anything else (the
    header, a bulk ticket) by protobuf.

    Raises ValueError for a malformed message, which gRPC reports to the caller as an INTERNAL error."""
    item = None
    # (a length-delimited field's value is a view, a varint's an int: fields() reads them by their wire type)
    for number, _, value in _Reader(memoryview(message)).fields():
        if number in (1, 2, 3) and isinstance(value, memoryview):
            item = (number, value)  # the oneof: the last one on the wire wins
    if item is None or item[0] != 2:
        return store_pb2.GetPackResponse.FromString(message)
    index, data, digest = 0, memoryview(b""), ""
    for number, _, value in _Reader(item[1]).fields():
        if number == 1 and isinstance(value, int):
            index = value & 0xFFFFFFFF  # uint32, as protobuf truncates it
        elif number == 2 and isinstance(value, memoryview):
            data = value
        elif number == 3 and isinstance(value, memoryview):
            digest = str(value, "utf-8")
    return ChunkPiece(index=index, data=data, digest=digest)


def get_pack_method(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """GetPack on ``channel`` with the hand-written reader for its chunk messages."""
    return channel.unary_stream(
        GET_PACK, request_serializer=store_pb2.GetPackRequest.SerializeToString, response_deserializer=parse_get_pack_response
    )


def chunk_pieces(index: int, data: bytes, digest: str) -> Iterator[store_pb2.Chunk]:
    """A chunk as consecutive Chunk messages with the same index (at least one, even when empty), made one at
    a time as they are sent, so a stream holds one piece beyond the chunk itself (an upload's; GetPack writes
    its chunk messages by hand: ``chunk_responses``)."""
    for piece in piece_views(data):
        yield store_pb2.Chunk(index=index, data=bytes(piece), digest=digest)


class ChunkAssembler:
    """Joins Chunk pieces back into whole chunks, using the header's stored sizes to know when each ends.
    ``indices``: the chunks expected, in order (a partial read's, or every chunk when None)."""

    def __init__(self, header: PackHeader, indices: Sequence[int] | None = None) -> None:
        self.header = header
        self.indices = tuple(indices) if indices is not None else tuple(range(len(header.chunks)))
        self.received = 0  # whole chunks so far
        self._parts: list[bytes | memoryview] = []
        self._size = 0

    def add(self, piece: store_pb2.Chunk | ChunkPiece) -> tuple[int, bytes | memoryview] | None:
        """Add one piece; returns (chunk index, whole chunk) when this piece completes it (a chunk that came in
        one piece is that piece's data, not copied)."""
        if self.received >= len(self.indices):
            raise InvalidInput(
                f"chunk {piece.index} arrived after the last chunk expected ({self.indices[-1] if self.indices else 'none'})"
            )
        index = self.indices[self.received]
        if piece.index != index:
            raise InvalidInput(f"chunk {piece.index} arrived where chunk {index} was expected")
        expected = self.header.chunks[index].stored_bytes
        data = piece.data  # each access of a protobuf bytes field copies it
        self._parts.append(data)
        self._size += len(data)
        if self._size > expected:
            raise InvalidInput(f"chunk {piece.index} is longer than the {expected} bytes the header states")
        if self._size < expected:
            return None
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts, self._size = [], 0
        self.received += 1
        return index, data

    @property
    def complete(self) -> bool:
        return self.received == len(self.indices) and not self._parts
