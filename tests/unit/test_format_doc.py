"""docs/format.md is the contract: decode a stored pack with only lmdb, zstandard, blake3, safetensors and its rules."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import blake3
import lmdb
import pytest
import torch
import zstandard
from safetensors.torch import load as safetensors_load

from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from tests.helpers.packs import make_pack
from tests.helpers.reference_codec import huffman_decode


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def byteplane_decode(stored: bytes, seen: set[int]) -> bytes:
    """The byte-plane container (versions 3 and 2) of docs/format.md §1.4, decoded from its description; the frame
    methods met are added to ``seen``."""
    magic, version, width, transform, header_len, elements, segment = struct.unpack_from("<4sBBBIQI", stored)
    assert magic == b"PSBP" and version in (2, 3) and transform in (0, 1, 2)
    per_plane = -(-elements // segment)
    plane_count = 3 if transform == 2 else width
    count = 1 + plane_count * per_plane
    table = [struct.unpack_from("<BI", stored, 23 + 5 * i) for i in range(count)]
    sizes = [min(segment, elements - s) for s in range(0, elements, segment)]
    packed = [(n // 256) * 64 + min(n % 256, 64) for n in sizes]
    plain_lengths = [header_len] + [size for j in range(plane_count) for size in (packed if transform == 2 and j == 2 else sizes)]
    offset, parts = 23 + 5 * count, []
    for (method, stored_len), plain_len in zip(table, plain_lengths):
        body = stored[offset : offset + stored_len]
        offset += stored_len
        seen.add(method)
        if method == 0:
            part = body
        elif method == 1:
            part = zstandard.ZstdDecompressor().decompress(body, max_output_size=plain_len)
        else:
            part = huffman_decode(body, plain_len)
        assert len(part) == plain_len
        parts.append(part)
    assert offset == len(stored)
    planes = [parts[1 + j * per_plane : 1 + (j + 1) * per_plane] for j in range(plane_count)]
    if transform == 2:
        low, high = b"".join(planes[0]), b"".join(planes[1])
        values = []
        for i in range(elements):
            group, e = planes[2][i // segment], i % segment
            bits = group[(e // 256) * 64 + e % 64] >> (2 * (e // 64 % 4)) & 3
            values.append(high[i] << 10 | bits << 8 | low[i])
    else:
        joined = [b"".join(plane) for plane in planes]
        values = [int.from_bytes(bytes(plane[i] for plane in joined), "little") for i in range(elements)]
        if transform == 1:
            values = [(v >> 1) | ((v & 1) << (8 * width - 1)) for v in values]
    return parts[0] + b"".join(v.to_bytes(width, "little") for v in values)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stored_pack_decodes_by_the_document_alone(store_path: Path, dtype: str) -> None:
    pack = make_pack(dtype, layers=2, tokens=40, dim=64)  # large enough for Huffman frames
    with LmdbStore(store_path) as store:
        store.put(encode_pack(pack), name="doc-test")

    env = lmdb.open(str(store_path), max_dbs=8, readonly=True)
    with env.begin() as txn:
        meta, packs, chunks, names = (env.open_db(n, txn=txn, create=False) for n in (b"meta", b"packs", b"chunks", b"names"))
        assert txn.get(b"layout", db=meta) == b"2"
        key = txn.get(f"{pack.header.model_fp}/doc-test".encode(), db=names).decode()
        raw_header = txn.get(key.encode(), db=packs)
        header = json.loads(raw_header)
        assert canonical(header) == raw_header
        assert header["format"] == "packstore-pack" and header["version"] == 4 and header["codec"] == "byteplane-3"
        sealed = {k: v for k, v in header.items() if k != "pack_sha256"}
        assert header["pack_sha256"] == hashlib.sha256(canonical(sealed)).hexdigest()

        ids = header["token_ids"]
        content_hash = hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()
        assert header["content_hash"] == content_hash and header["tokens"] == len(ids)
        assert key == f"{header['model_fp']}/{header['template_fp']}/{content_hash}"
        assert header["source_sha256"] == hashlib.sha256(canonical(header["facts"])).hexdigest()

        tensors, methods = {}, set()
        for index, info in enumerate(header["chunks"]):
            data = txn.get(key.encode() + b"#" + struct.pack(">I", index), db=chunks)
            assert len(data) == info["stored_bytes"]
            assert blake3.blake3(data).hexdigest() == info["blake3"]
            part = safetensors_load(byteplane_decode(data, methods))
            assert set(part) == {f"layers.{i}.{kv}" for i in range(info["first_layer"], info["stop_layer"]) for kv in ("key", "value")}
            assert sum(t.numel() * t.element_size() for t in part.values()) == info["raw_bytes"]
            tensors.update(part)
    env.close()
    assert 2 in methods  # Huffman frames were among those decoded

    for i in range(header["layers"]):
        for name, expected in (("key", pack.keys[i]), ("value", pack.values[i])):
            tensor = tensors[f"layers.{i}.{name}"]
            assert list(tensor.shape) == [header["kv_heads"], header["tokens"], header["head_dim"]]
            assert str(tensor.dtype) == f"torch.{header['dtype']}"
            assert torch.equal(tensor, expected)
