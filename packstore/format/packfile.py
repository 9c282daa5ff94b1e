"""Single-file packs for moving between stores: magic, version, header length, header, chunks, signatures.

    b"PKSTPACK" | file version u32 LE | header length u64 LE | header JSON | chunk 0 | chunk 1 | ...
    version 2 then: signature count u32 LE | per signature: length u32 LE | record JSON

Chunk lengths come from the header, which seals them with their sha256 and its own pack_sha256.
Writers write version 1 for a pack without signatures, version 2 otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from packstore.errors import IntegrityError, InvalidInput
from packstore.format.body import EncodedPack, verify_chunk
from packstore.format.header import PackHeader
from packstore.format.signature import MAX_SIGNATURE_BYTES, Signature

FILE_MAGIC = b"PKSTPACK"
FILE_VERSIONS = (1, 2)  # 2 adds the signatures after the chunks
_PREAMBLE = struct.Struct("<8sIQ")
_COUNT = struct.Struct("<I")
MAX_HEADER_BYTES = 64 << 20
MAX_SIGNATURES = 1024


def pack_file_parts(encoded: EncodedPack) -> Iterator[bytes]:
    """The bytes of a pack file, in pieces to write one after another."""
    header = encoded.header.to_json()
    yield _PREAMBLE.pack(FILE_MAGIC, 2 if encoded.signatures else 1, len(header))
    yield header
    yield from encoded.chunks
    if encoded.signatures:
        yield _COUNT.pack(len(encoded.signatures))
        for signature in encoded.signatures:
            record = signature.to_json()
            yield _COUNT.pack(len(record)) + record


def parse_pack_file(data: bytes) -> EncodedPack:
    """Read a pack file, checking its framing, header seal and every chunk's checksum."""
    if len(data) < _PREAMBLE.size:
        raise IntegrityError("not a packstore pack file: too short")
    magic, version, header_len = _PREAMBLE.unpack_from(data)
    if magic != FILE_MAGIC:
        raise IntegrityError("not a packstore pack file: bad magic")
    if version not in FILE_VERSIONS:
        readable = f"{FILE_VERSIONS[0]} to {FILE_VERSIONS[-1]}"
        raise IntegrityError(f"pack file version {version} is not supported (this build reads versions {readable})")
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
    signatures: list[Signature] = []
    if version == 2:
        offset, signatures = _signatures(data, offset)
    if offset != len(data):
        raise IntegrityError(f"pack file has {len(data) - offset} unexpected bytes after its last {'signature' if signatures else 'chunk'}")
    encoded = EncodedPack(header=header, chunks=chunks, signatures=tuple(signatures))
    encoded.check_signatures()
    return encoded


def _signatures(data: bytes, offset: int) -> tuple[int, list[Signature]]:
    """The signature section of a version-2 file from ``offset``: (end offset, signatures)."""
    if offset + _COUNT.size > len(data):
        raise IntegrityError("pack file is truncated before its signatures")
    (count,) = _COUNT.unpack_from(data, offset)
    if count > MAX_SIGNATURES:
        raise IntegrityError(f"pack file declares {count} signatures, more than {MAX_SIGNATURES}")
    offset += _COUNT.size
    found = []
    for index in range(count):
        if offset + _COUNT.size > len(data):
            raise IntegrityError(f"pack file is truncated in signature {index}")
        (length,) = _COUNT.unpack_from(data, offset)
        offset += _COUNT.size
        if length > MAX_SIGNATURE_BYTES or offset + length > len(data):
            raise IntegrityError(f"pack file signature {index} is truncated or too long ({length} bytes)")
        try:
            found.append(Signature.from_json(data[offset : offset + length]))
        except InvalidInput as exc:
            raise IntegrityError(f"pack file signature {index} is malformed: {exc}") from None
        offset += length
    return offset, found
