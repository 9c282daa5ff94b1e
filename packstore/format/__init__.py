"""Pack format: pure bytes <-> tensors, no I/O. See docs/format.md."""

from packstore.format.header import (
    FORMAT_VERSION,
    ChunkInfo,
    PackHeader,
    content_hash,
    pack_key,
    parse_key,
)
from packstore.format.body import Pack, EncodedPack, decode_pack, encode_pack

__all__ = [
    "FORMAT_VERSION",
    "ChunkInfo",
    "PackHeader",
    "content_hash",
    "pack_key",
    "parse_key",
    "Pack",
    "EncodedPack",
    "decode_pack",
    "encode_pack",
]
