"""The strict safetensors table reader: every layout rule refused on a hand-built blob, as safetensors does."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import struct

import blake3
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from packstore.errors import IntegrityError
from packstore.format import codec
from packstore.format.body import MAX_TABLE_BYTES, EncodedPack, tensor_table
from packstore.packs.tensors import decode_pack, encode_pack
from tests.helpers.packs import make_pack


def raw_blob(table: str, data_bytes: int) -> bytearray:
    """A safetensors blob: 8-byte table size, the table text, then ``data_bytes`` zero bytes."""
    raw = table.encode()
    return bytearray(struct.pack("<Q", len(raw)) + raw + bytes(data_bytes))


def blob(table: object, data_bytes: int) -> bytearray:
    return raw_blob(json.dumps(table), data_bytes)


def f32(start: int, stop: int, shape: list | None = None) -> dict:
    return {"dtype": "F32", "shape": [(stop - start) // 4] if shape is None else shape, "data_offsets": [start, stop]}


# (blob, message the reader gives, whether safetensors itself refuses it)
CASES = {
    "aliased K/V": (blob({"k": f32(0, 8), "v": f32(0, 8)}, 8), "'v': aliases the bytes of tensor 'k'", True),
    "overlapping": (blob({"k": f32(0, 8), "v": f32(4, 12)}, 12), "'v': overlaps tensor 'k'", True),
    "gap": (blob({"k": f32(0, 8), "v": f32(12, 20)}, 20), "'v': 4 unused bytes after tensor 'k'", True),
    "not starting at 0": (blob({"k": f32(4, 12)}, 12), "'k': 4 unused bytes at the start", True),
    "trailing bytes": (blob({"k": f32(0, 8)}, 12), "4 trailing bytes after tensor 'k'", True),
    "wrong size": (blob({"k": f32(0, 12, [2])}, 12), "'k': holds 12 bytes, but shape \\[2\\] of F32 needs 8", True),
    "shape beyond the data": (blob({"k": f32(0, 8, [2] * 10_000)}, 8), "'k': its shape of F32 needs more than the 8-byte", True),
    "past the data": (blob({"k": f32(0, 16)}, 8), "'k': data_offsets \\[0, 16\\] run past", True),
    "reversed offsets": (blob({"k": f32(8, 0, [0])}, 8), "'k': data_offsets \\[8, 0\\] are not", True),
    "header size over the cap": (bytearray(struct.pack("<Q", MAX_TABLE_BYTES + 1) + b"{}"), "exceeds the 100000000-byte limit", True),
    "header size past the blob": (bytearray(struct.pack("<Q", 100) + b"{}"), "header size 100 runs past the end", True),
    "shorter than its size field": (bytearray(b"\x02\x00"), "shorter than its 8-byte header size", True),
    "header not an object": (blob([1, 2], 0), "is a JSON list, not an object", True),
    "header not JSON": (raw_blob("{x}", 0), "not valid JSON", True),
    "bad dtype": (blob({"k": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, 8), "'k': unknown dtype 'Q7'", True),
    "negative shape": (blob({"k": f32(0, 8, [-2])}, 8), "'k': shape \\[-2\\] is not a list of non-negative", True),
    "metadata not strings": (blob({"__metadata__": {"a": 1}, "k": f32(0, 8)}, 8), "__metadata__ must be an object of strings", True),
    # stricter than safetensors, which keeps the last of two entries and ignores unknown fields
    "duplicate name": (raw_blob(f'{{"k": {json.dumps(f32(0, 8))}, "k": {json.dumps(f32(0, 8))}}}', 8), "names 'k' twice", False),
    "unknown entry field": (blob({"k": f32(0, 8) | {"extra": 1}}, 8), "'k': entry must be an object with exactly", False),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_each_layout_rule_is_refused_with_the_tensor_and_rule_named(case: str) -> None:
    data, message, safetensors_refuses = CASES[case]
    with pytest.raises(IntegrityError, match=message):
        tensor_table(data)
    if safetensors_refuses:
        with pytest.raises(SafetensorError):
            safetensors_load(bytes(data))


def test_a_safetensors_blob_table_names_each_tensor() -> None:
    tensors = {"layers.0.key": torch.randn(2, 3, 4), "layers.0.value": torch.randn(2, 3, 4).half(), "empty": torch.zeros(0)}
    data = bytearray(safetensors_save(tensors, metadata={"note": "kept"}))
    table = {entry.name: entry for entry in tensor_table(data)}
    assert table["layers.0.key"].dtype == "float32" and table["layers.0.value"].dtype == "float16"
    assert table["layers.0.key"].shape == (2, 3, 4)


def test_a_checksummed_chunk_whose_k_and_v_share_bytes_is_refused() -> None:
    encoded = encode_pack(make_pack(layers=1, tokens=2, heads=1, dim=2))
    shape = [1, 2, 2]
    aliased = blob({"layers.0.key": f32(0, 16, shape), "layers.0.value": f32(0, 16, shape)}, 16)
    stored = codec.encode(bytes(aliased), "float32", segment=codec.SEGMENT)  # the writer's own table check would refuse it
    info = dataclasses.replace(encoded.header.chunks[0], stored_bytes=len(stored), digest=blake3.blake3(stored).hexdigest())
    header = dataclasses.replace(encoded.header, chunks=(info,))
    with pytest.raises(IntegrityError, match="chunk 0 cannot be decoded: tensor 'layers.0.value': aliases the bytes of tensor 'layers.0.key'"):
        decode_pack(EncodedPack(header, [stored]))


def _round_trip_exits_zero() -> None:
    pack = make_pack(tokens=40)
    decoded = decode_pack(encode_pack(pack, block_positions=16))
    raise SystemExit(0 if torch.equal(decoded.values[2], pack.values[2]) else 3)


def test_a_forked_child_codes_chunks_in_its_own_pool() -> None:
    """The chunk pool lives for the process; a child forked after its threads started has none of them, so it
    must start its own rather than queue work that no thread takes (it used to hang)."""
    decode_pack(encode_pack(make_pack(tokens=40), block_positions=16))  # the parent's pool threads are running
    child = multiprocessing.get_context("fork").Process(target=_round_trip_exits_zero)
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
