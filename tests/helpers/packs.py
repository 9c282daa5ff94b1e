"""Synthetic packs for tests that need a valid pack but no model (seeded random K/V of a small shape under fixed
fingerprints), a pack under a fingerprint of a test's own, a forged header, and a bit flipped in a store file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from packstore.format import PackHeader
from packstore.format.header import canonical_json, sha256_hex
from packstore.packs.tensors import Pack, torch_dtype

FP_A = "a" * 64
FP_B = "b" * 64


def make_pack(dtype: str = "float32", layers: int = 3, tokens: int = 5, heads: int = 2, dim: int = 4) -> Pack:
    header = PackHeader(
        kind="knowledge",
        model_fp=FP_A,
        template_fp=FP_B,
        model_name="test",
        token_ids=tuple(range(10, 10 + tokens)),
        layers=layers,
        kv_heads=heads,
        head_dim=dim,
        dtype=dtype,
        facts=("one fact", "another fact, with ünïcode"),
        raw=False,
        created="2026-01-01T00:00:00Z",
    )
    gen = torch.Generator().manual_seed(0)
    shape = (heads, tokens, dim)
    keys = [torch.randn(shape, generator=gen).to(torch_dtype(dtype)) for _ in range(layers)]
    values = [torch.randn(shape, generator=gen).to(torch_dtype(dtype)) for _ in range(layers)]
    return Pack(header=header, keys=keys, values=values)


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
