"""Synthetic packs for tests: ``make_pack`` (seeded random K/V under fixed fingerprints, shared with the tools in
``tools.lib.packs``), a pack under a fingerprint of a test's own, a forged header, and a bit flipped in a store file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from packstore.format import PackHeader
from packstore.format.header import canonical_json, sha256_hex
from packstore.packs.tensors import Pack
from tools.lib.packs import FP_A, FP_B, make_pack

__all__ = ["FP_A", "FP_B", "flip_in_file", "make_pack", "pack_of", "resealed"]


def pack_of(model_fp: str, first_token: int = 10, *, template_fp: str = FP_B, tokens: int = 5) -> Pack:
    pack = make_pack(tokens=tokens)
    header = dataclasses.replace(
        pack.header, model_fp=model_fp, template_fp=template_fp, token_ids=tuple(range(first_token, first_token + tokens))
    )
    return dataclasses.replace(pack, header=header)


def resealed(header: PackHeader, **changes: object) -> bytes:
    """``header``'s JSON with ``changes`` (None: drop the field), sealed again as a forger would."""
    record = {k: v for k, v in json.loads(header.to_json()).items() if k != "pack_sha256"}
    record.update(changes)
    record = {k: v for k, v in record.items() if v is not None}
    return canonical_json({**record, "pack_sha256": sha256_hex(canonical_json(record))})


def flip_in_file(path: Path, needle: bytes, at: int) -> None:
    """Flip one bit of the byte ``at`` positions into every copy of ``needle`` in the file.

    Every copy: freed LMDB pages (e.g. of a staged upload) may still hold stale copies of the bytes.
    """
    data = bytearray(path.read_bytes())
    offset = data.find(needle)
    assert offset >= 0, "the bytes to damage are not in the file"
    while offset >= 0:
        data[offset + at] ^= 0x10
        offset = data.find(needle, offset + 1)
    path.write_bytes(bytes(data))
