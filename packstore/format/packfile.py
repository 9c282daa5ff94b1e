"""Single-file packs for moving between stores: magic, version, header length, header, chunks.

    b"PKSTPACK" | file version u32 LE = 1 | header length u64 LE | header JSON | chunk 0 | chunk 1 | ...

Chunk lengths come from the header, which seals them with their sha256 and its own pack_sha256.
"""

from __future__ import annotations

import struct
from typing import Iterator

from packstore.errors import IntegrityError
from packstore.format.body import EncodedPack, verify_chunk
from packstore.format.header import PackHeader

FILE_MAGIC = b"PKSTPACK"
FILE_VERSION = 1
_PREAMBLE = struct.Struct("<8sIQ")
MAX_HEADER_BYTES = 64 << 20


def pack_file_parts(encoded: EncodedPack) -> Iterator[bytes]:
    """The bytes of a pack file, in pieces to write one after another."""
    header = encoded.header.to_json()
    yield _PREAMBLE.pack(FILE_MAGIC, FILE_VERSION, len(header))
    yield header
    yield from encoded.chunks


def parse_pack_file(data: bytes) -> EncodedPack:
    """Read a pack file, checking its framing, header seal and every chunk's checksum."""
    if len(data) < _PREAMBLE.size:
        raise IntegrityError("not a packstore pack file: too short")
    magic, version, header_len = _PREAMBLE.unpack_from(data)
    if magic != FILE_MAGIC:
        raise IntegrityError("not a packstore pack file: bad magic")
    if version != FILE_VERSION:
        raise IntegrityError(f"pack file version {version} is not supported (this build reads {FILE_VERSION})")
    if header_len > min(MAX_HEADER_BYTES, len(data) - _PREAMBLE.size):
        raise IntegrityError("pack file is truncated or its header length is corrupt")
    offset = _PREAMBLE.size + header_len
    header = PackHeader.from_json(data[_PREAMBLE.size : offset])
    header.validate(encoded=True)  # a pack file holds a stored pack: every layer's chunk, coded
    chunks = []
    for index, info in enumerate(header.chunks):
        chunk = data[offset : offset + info.stored_bytes]
        offset += info.stored_bytes
        if len(chunk) != info.stored_bytes:
            raise IntegrityError(f"pack file is truncated in chunk {index}")
        verify_chunk(header, index, chunk)
        chunks.append(chunk)
    if offset != len(data):
        raise IntegrityError(f"pack file has {len(data) - offset} unexpected bytes after its last chunk")
    return EncodedPack(header=header, chunks=chunks)
