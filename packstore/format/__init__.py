"""Pack format: bytes <-> header, chunks, pack file and bank records; no torch, no I/O. See docs/format.md.

The tensor side (chunk bytes <-> K/V tensors) is ``packstore.packs.tensors``.
"""

from packstore.format.body import EncodedPack
from packstore.format.header import (
    FORMAT_VERSION,
    ChunkInfo,
    PackHeader,
    content_hash,
    pack_key,
    parse_key,
)

__all__ = [
    "FORMAT_VERSION",
    "ChunkInfo",
    "PackHeader",
    "content_hash",
    "pack_key",
    "parse_key",
    "EncodedPack",
]
