"""GetPack's hand-written chunk messages are protobuf's wire format, byte for byte, both ways."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packstore.packs.tensors import encode_pack
from packstore.rpc.wire import (
    PIECE_BYTES,
    ChunkAssembler,
    ChunkPiece,
    chunk_responses,
    parse_get_pack_response,
    serialize_get_pack_response,
)
from packstore.v1 import store_pb2
from tests.helpers.packs import make_pack

DIGESTS = st.one_of(st.just(""), st.text(alphabet="0123456789abcdef", min_size=64, max_size=64), st.text(max_size=80))


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, 2**32 - 1), data=st.binary(max_size=3000), digest=DIGESTS)
def test_a_chunk_message_is_what_protobuf_writes_and_reads_back_as_protobuf_does(index: int, data: bytes, digest: str) -> None:
    [message] = chunk_responses(index, data, digest)
    expected = store_pb2.GetPackResponse(chunk=store_pb2.Chunk(index=index, data=data, digest=digest))
    assert message == expected.SerializeToString()
    piece = parse_get_pack_response(message)
    assert isinstance(piece, ChunkPiece) and (piece.index, bytes(piece.data), piece.digest) == (index, data, digest)


def test_a_chunk_longer_than_a_piece_goes_in_pieces_of_at_most_piece_bytes() -> None:
    data = bytes(range(256)) * (PIECE_BYTES // 256 * 2 + 3)
    messages = list(chunk_responses(7, data, "ab"))
    pieces = [store_pb2.GetPackResponse.FromString(m).chunk for m in messages]
    assert [len(p.data) for p in pieces] == [PIECE_BYTES, PIECE_BYTES, 768]
    assert {p.index for p in pieces} == {7} and b"".join(p.data for p in pieces) == data


def test_the_reader_takes_protobuf_messages_with_fields_in_any_order_and_unknown_fields() -> None:
    chunk = store_pb2.Chunk(index=3, data=b"xyz", digest="d").SerializeToString()
    reordered = b"\x1a\x01d" + b"\x12\x03xyz" + b"\x08\x03" + b"\x20\x05" + b"\x2d\x00\x00\x00\x00"  # + unknown fields 4 and 5
    for inner in (chunk, reordered):
        piece = parse_get_pack_response(b"\x12" + bytes([len(inner)]) + inner)
        assert (piece.index, bytes(piece.data), piece.digest) == (3, b"xyz", "d")
    header = store_pb2.GetPackResponse(header=store_pb2.PackInfo(key="k", stored_bytes=5))
    assert parse_get_pack_response(header.SerializeToString()) == header
    ticket = store_pb2.GetPackResponse(bulk=store_pb2.BulkTicket(port=5, ticket=b"\x12" * 32, expires_ms=30000))
    assert parse_get_pack_response(ticket.SerializeToString()) == ticket
    assert serialize_get_pack_response(header) == header.SerializeToString()
    assert serialize_get_pack_response(b"as written") == b"as written"


@pytest.mark.parametrize(
    "message",
    [
        b"\x12\x05\x08\x01",  # a field running past the end
        b"\x12\x02\x08",  # a truncated varint
        b"\x12\x03\x0b\x01\x02",  # a group (wire type 3)
        b"\x12\x04\x1a\x02\xff\xfe",  # a digest that is not UTF-8
        b"\x12\x0b" + b"\x08" + b"\xff" * 10,  # a varint over 64 bits
    ],
)
def test_a_malformed_message_is_refused(message: bytes) -> None:
    with pytest.raises(ValueError):
        parse_get_pack_response(message)


def test_a_chunk_that_came_in_one_piece_is_assembled_without_a_copy() -> None:
    encoded = encode_pack(make_pack(layers=1))
    header, data = encoded.header, encoded.chunks[0]
    [message] = chunk_responses(0, data, header.chunks[0].digest)
    piece = parse_get_pack_response(message)
    index, whole = ChunkAssembler(header).add(piece)
    assert index == 0 and whole is piece.data and bytes(whole) == data
