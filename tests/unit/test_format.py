"""Pack format: header encoding, key derivation, body round trips and damage detection."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import reprlib
import struct

import blake3
import pytest
import torch

from packstore.errors import IntegrityError, InvalidInput
from packstore.format import EncodedPack, PackHeader, content_hash, pack_key, parse_key
from packstore.format import header as header_format
from packstore.format.header import canonical_json, sha256_hex
from packstore.packs.tensors import decode_pack, encode_pack
from tests.helpers.packs import FP_A, FP_B, make_pack, resealed


def test_content_hash_is_sha256_of_little_endian_uint32_ids() -> None:
    assert content_hash([1, 2, 65536]) == hashlib.sha256(struct.pack("<3I", 1, 2, 65536)).hexdigest()
    assert pack_key(FP_A, FP_B, [1]) == f"{FP_A}/{FP_B}/{content_hash([1])}"


def test_parse_key_accepts_only_full_keys() -> None:
    key = pack_key(FP_A, FP_B, [1, 2])
    assert parse_key(key) == tuple(key.split("/"))
    for not_key in ("name", f"{FP_A}/{FP_B}", key.upper(), key + "/x"):
        assert parse_key(not_key) is None


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_body_round_trip_is_bit_exact(dtype: str) -> None:
    pack = make_pack(dtype)
    decoded = decode_pack(encode_pack(pack))
    assert decoded.header.key == pack.header.key
    for a, b in zip(pack.keys + pack.values, decoded.keys + decoded.values):
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_header_json_round_trip_and_is_canonical() -> None:
    encoded = encode_pack(make_pack())
    data = encoded.header.to_json()
    again = PackHeader.from_json(data)
    assert again == encoded.header
    assert again.to_json() == data
    assert encoded.header.raw_bytes == 2 * 3 * 2 * 5 * 4 * 4



def test_headers_are_encoded_once_and_parsed_once_per_bytes() -> None:
    header = encode_pack(make_pack()).header
    data = header.to_json()
    assert header.to_json() is data  # made once: the header is immutable
    assert dataclasses.replace(header, created="2026-01-02T00:00:00Z").to_json() != data  # a changed copy is encoded afresh
    parsed = PackHeader.from_json(data)
    assert PackHeader.from_json(bytearray(data)) is parsed  # the same bytes: the header parsed before
    with pytest.raises(IntegrityError, match="pack_sha256"):
        PackHeader.from_json(data.replace(b"one fact", b"One fact"))  # a refusal is never remembered
    with pytest.raises(IntegrityError, match="pack_sha256"):
        PackHeader.from_json(data.replace(b"one fact", b"One fact"))
    big = dataclasses.replace(header, facts=("x" * header_format.PARSED_MAX_BYTES,))
    assert PackHeader.from_json(big.to_json()) is not PackHeader.from_json(big.to_json())  # too large to remember

def reseal(record: dict) -> bytes:
    """Re-encode a header record with a matching pack_sha256, as a careless writer would."""
    record = {k: v for k, v in record.items() if k != "pack_sha256"}
    record["pack_sha256"] = sha256_hex(canonical_json(record))
    return canonical_json(record)


def test_header_with_inconsistent_derived_field_is_rejected() -> None:
    record = json.loads(encode_pack(make_pack()).header.to_json())
    record["tokens"] = 6
    with pytest.raises(IntegrityError, match="tokens"):
        PackHeader.from_json(reseal(record))


def test_any_damaged_header_byte_is_detected() -> None:
    data = encode_pack(make_pack()).header.to_json()
    damaged = data.replace(b"2026-01-01", b"2026-01-02")
    with pytest.raises(IntegrityError, match="pack_sha256"):
        PackHeader.from_json(damaged)


def test_header_of_unknown_version_is_rejected() -> None:
    record = json.loads(encode_pack(make_pack()).header.to_json())
    record["version"] = 99
    with pytest.raises(IntegrityError, match="version 99"):
        PackHeader.from_json(reseal(record))


KEY_1, KEY_2 = f"{FP_A}/{FP_B}/{'1' * 64}", f"{FP_A}/{FP_B}/{'2' * 64}"


def spliced(composition: str = "rope", parents: tuple[str, ...] = (KEY_1, KEY_2)) -> PackHeader:
    pack = encode_pack(make_pack())
    return dataclasses.replace(pack.header, composition=composition, parents=parents)


def sha256_chunks(encoded: EncodedPack) -> EncodedPack:
    """``encoded`` as a writer before version 4 stored it: the same bytes with sha256 chunk digests."""
    chunks = tuple(
        dataclasses.replace(info, digest=hashlib.sha256(data).hexdigest(), algorithm="sha256")
        for info, data in zip(encoded.header.chunks, encoded.chunks)
    )
    return dataclasses.replace(encoded, header=dataclasses.replace(encoded.header, chunks=chunks))


def test_spliced_packs_have_a_composition_and_hash_their_recipe() -> None:
    exact = encode_pack(make_pack()).header
    rope, naive = spliced("rope"), spliced("naive")
    assert json.loads(exact.to_json())["version"] == 4 and "composition" not in json.loads(exact.to_json())
    record = json.loads(rope.to_json())
    assert record["version"] == 4 and record["composition"] == "rope"
    assert PackHeader.from_json(rope.to_json()) == rope
    assert len({exact.key, rope.key, naive.key, spliced("rope", (KEY_2, KEY_1)).key}) == 4
    recipe = {"composition": "rope", "parents": [KEY_1, KEY_2], "tokens": content_hash(exact.token_ids)}
    assert rope.content_hash == sha256_hex(canonical_json(recipe)) == record["content_hash"]
    assert exact.content_hash == content_hash(exact.token_ids)


@pytest.mark.parametrize(
    "change,error,message",
    [
        (lambda r: r.update(version=1), InvalidInput, "'composition' is not a field of a version-1"),
        (lambda r: r.update(composition="exact"), InvalidInput, "'composition' must be absent for an exact pack"),
        (lambda r: r.update(composition="sideways"), InvalidInput, "'composition' must be one of"),
        (lambda r: r.update(parents=[KEY_1]), InvalidInput, "at least 2 parts"),
        (lambda r: r.update(content_hash=content_hash(r["token_ids"])), IntegrityError, "content_hash"),
    ],
)
def test_bad_spliced_headers_are_refused(change, error, message) -> None:
    record = json.loads(spliced().to_json())
    change(record)
    with pytest.raises(error, match=message):
        PackHeader.from_json(reseal(record))


def test_version_4_names_blake3_chunk_digests_and_earlier_versions_sha256() -> None:
    encoded = encode_pack(make_pack())
    record = json.loads(encoded.header.to_json())
    assert [sorted(chunk) for chunk in record["chunks"]] == [["blake3", "first_layer", "raw_bytes", "stop_layer", "stored_bytes"]] * 3
    assert all(chunk["blake3"] == blake3.blake3(data).hexdigest() for chunk, data in zip(record["chunks"], encoded.chunks))
    older = sha256_chunks(encoded)
    for header, version in ((older.header, 1), (dataclasses.replace(older.header, composition="rope", parents=(KEY_1, KEY_2)), 2)):
        record = json.loads(header.to_json())
        assert record["version"] == version and all(chunk["sha256"] for chunk in record["chunks"])
        assert PackHeader.from_json(header.to_json()) == header
    assert torch.equal(decode_pack(older).keys[1], decode_pack(encoded).keys[1])
    damaged = bytearray(older.chunks[0])
    damaged[-1] ^= 1
    with pytest.raises(IntegrityError, match="chunk 0"):
        decode_pack(dataclasses.replace(older, chunks=[bytes(damaged), *older.chunks[1:]]))


@pytest.mark.parametrize(
    "version,entry,message",
    [
        (4, "sha256", "exactly the fields first_layer, stop_layer, raw_bytes, stored_bytes, blake3"),
        (1, "blake3", "exactly the fields first_layer, stop_layer, raw_bytes, stored_bytes, sha256"),
        (4, None, "'chunks' must be the stored chunks in a version-4 header"),
    ],
)
def test_the_chunk_digest_must_be_the_versions(version: int, entry: str | None, message: str) -> None:
    record = json.loads(encode_pack(make_pack()).header.to_json())
    record["version"] = version
    if entry is None:
        record["chunks"] = []
    for chunk in record["chunks"]:
        chunk[entry] = chunk.pop("blake3")
    with pytest.raises((InvalidInput, IntegrityError), match=message):
        PackHeader.from_json(reseal(record))


def test_damaged_chunk_is_detected_and_named() -> None:
    encoded = encode_pack(make_pack())
    chunks = list(encoded.chunks)
    damaged = bytearray(chunks[1])
    damaged[len(damaged) // 2] ^= 0x01
    chunks[1] = bytes(damaged)
    with pytest.raises(IntegrityError, match="chunk 1"):
        decode_pack(dataclasses.replace(encoded, chunks=chunks))


def test_missing_chunk_is_detected() -> None:
    encoded = encode_pack(make_pack())
    with pytest.raises(IntegrityError, match="chunks"):
        decode_pack(dataclasses.replace(encoded, chunks=encoded.chunks[:-1]))


def test_tensor_shapes_must_match_header() -> None:
    pack = make_pack()
    pack.keys[0] = pack.keys[0][:, :3]
    with pytest.raises(InvalidInput, match="layer 0 K"):
        encode_pack(pack)


def test_header_validation_rejects_bad_fields() -> None:
    header = make_pack().header
    with pytest.raises(InvalidInput, match="kind"):
        dataclasses.replace(header, kind="mystery").validate()
    with pytest.raises(InvalidInput, match="model_fp"):
        dataclasses.replace(header, model_fp="xyz").validate()
    with pytest.raises(InvalidInput, match="token"):
        dataclasses.replace(header, token_ids=()).validate()


def bad_chunks(header: PackHeader) -> dict[str, tuple]:
    """Chunk lists of an encoded header that break one chunk rule each."""
    first, second, third = header.chunks
    return {
        "chunks[0].raw_bytes": (dataclasses.replace(first, raw_bytes=first.raw_bytes + 1), second, third),
        "chunks[1].first_layer": (first, third, second),
        "chunks[1].stop_layer": (first, dataclasses.replace(second, stop_layer=1), third),
        "chunks[0].stored_bytes": (dataclasses.replace(first, stored_bytes=1 << 40), second, third),
        "chunks[2].blake3": (first, second, dataclasses.replace(third, digest="A" * 64)),
        "chunks[1]": (first, {"first_layer": 1}, third),
        "chunks": (first, second),
    }


def test_token_blocks_round_trip_and_their_order_is_checked() -> None:
    pack = make_pack(tokens=5)
    encoded = encode_pack(pack, block_positions=2)  # per layer: positions 0-1, 2-3, 4
    header = encoded.header
    assert [(c.first_layer, c.first_position, c.stop_position) for c in header.chunks[:4]] == [(0, 0, 2), (0, 2, 4), (0, 4, 5), (1, 0, 2)]
    assert PackHeader.from_json(header.to_json()) == header and b'"first_position":2' in header.to_json()
    decoded = decode_pack(encoded)
    assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, decoded.keys + decoded.values))
    whole = encode_pack(pack).header.chunks[0]  # five fields: every position of layer 0
    assert b"first_position" not in encode_pack(pack).header.to_json()
    c = list(header.chunks)
    bad = {
        "chunks[1].first_position": [c[0], c[2], c[1], *c[3:]],
        "chunks[2].stop_position": [c[0], c[1], dataclasses.replace(c[2], stop_position=6), *c[3:]],
        "chunks[1]'": [c[0], whole, *c[3:]],  # a whole-layer chunk inside a run of blocks
        "chunks[1].stop_layer": [c[0], dataclasses.replace(c[1], stop_layer=2), *c[2:]],
        "chunks[0].raw_bytes": [dataclasses.replace(c[0], raw_bytes=c[0].raw_bytes + 1), *c[1:]],
        "chunks'": c[:-1],  # layer 2 stops at position 3
    }
    for field, chunks in bad.items():
        with pytest.raises(InvalidInput, match=re.escape(f"field '{field.rstrip(chr(39))}'")):
            dataclasses.replace(header, chunks=tuple(chunks)).validate()
    recipe = {"pairs": [{"good": "a", "bad": "b"}], "pooling": "last", "layers": [0, 2]}
    steering = dataclasses.replace(header, kind="steering", token_ids=(), facts=(), recipe=recipe, metrics={})
    block = dataclasses.replace(c[0], raw_bytes=2 * 2 * 4 * 4, first_position=0, stop_position=1)
    with pytest.raises(InvalidInput, match="is a token block, which only a knowledge pack's chunks may be"):
        dataclasses.replace(steering, chunks=(block,)).validate()


PYTHON_BAD_FIELDS = [
    ("model_name", 123),
    ("model_name", "m" * 4097),
    ("token_ids", (1, 1 << 32)),
    ("token_ids", (True,)),
    ("token_ids", tuple(range(1 << 20 | 1))),
    ("layers", 0),
    ("kv_heads", 1025),
    ("head_dim", True),
    ("dtype", "float64"),
    ("facts", ("a", 1)),
    ("raw", 1),
    ("created", "t" * 65),
    ("parents", (f"{FP_A}/{FP_B}/{FP_A}\n",)),
    ("codec", None),
    ("template_fp", FP_B + "\n"),
]


@pytest.mark.parametrize("field,value", PYTHON_BAD_FIELDS, ids=[f"{f}={reprlib.repr(v)[:10]}" for f, v in PYTHON_BAD_FIELDS])
def test_validate_names_the_field_of_a_python_built_header(field: str, value: object) -> None:
    header = dataclasses.replace(make_pack().header, **{field: value})
    with pytest.raises(InvalidInput, match=rf"^pack header field '{field}(\[\d+\])?' must be"):
        header.validate()


def test_validate_applies_the_chunk_rules() -> None:
    header = encode_pack(make_pack()).header
    header.validate(encoded=True)
    for field, chunks in bad_chunks(header).items():
        with pytest.raises(InvalidInput, match=rf"^pack header field '{re.escape(field)}' must"):
            dataclasses.replace(header, chunks=chunks).validate()


def test_validate_encoded_demands_every_chunk_and_the_codec() -> None:
    header = make_pack().header
    header.validate()
    with pytest.raises(InvalidInput, match="'chunks' must list the stored chunks of all 3 layers"):
        header.validate(encoded=True)
    with pytest.raises(InvalidInput, match=r"'codec' must be one of \['byteplane-3', 'byteplane-zstd', 'byteplane-zstd-2'\]"):
        dataclasses.replace(encode_pack(make_pack()).header, codec="").validate(encoded=True)


def test_from_json_checks_json_types_exactly() -> None:
    header = encode_pack(make_pack()).header
    first, *rest = json.loads(header.to_json())["chunks"]
    cases = {
        "layers": {"layers": 3.0},
        "raw": {"raw": 0},
        "token_ids[0]": {"token_ids": [10.0, 11, 12, 13, 14]},
        "chunks[0].stop_layer": {"chunks": [{**first, "stop_layer": True}, *rest]},
        "chunks[0]": {"chunks": [{**first, "extra": 1}, *rest]},
        "extra": {"extra": 1},
        "codec": {"codec": None},
    }
    for field, changes in cases.items():
        with pytest.raises(InvalidInput, match=rf"^pack header field '{re.escape(field)}' (must|is)"):
            PackHeader.from_json(resealed(header, **changes))
    assert PackHeader.from_json(resealed(header)) == header


BUILT_ON = {"device": "cuda", "dtype": "float32"}


def test_how_a_pack_was_prefilled_round_trips_and_is_absent_where_unknown() -> None:
    pack = make_pack()
    recorded = encode_pack(dataclasses.replace(pack, header=dataclasses.replace(pack.header, prefill_chunks=(0, 2, 5), built_on=BUILT_ON)))
    record = json.loads(recorded.header.to_json())
    assert (record["prefill_chunks"], record["built_on"]) == ([0, 2, 5], BUILT_ON)
    again = PackHeader.from_json(recorded.header.to_json())
    assert again == recorded.header and again.to_json() == recorded.header.to_json()
    assert again.prefill_chunks == (0, 2, 5) and again.key == encode_pack(pack).header.key  # how it was computed is not its key
    unknown = encode_pack(pack).header  # as every pack written before the fields: absent, parsed as unknown
    assert not {"prefill_chunks", "built_on"} & json.loads(unknown.to_json()).keys()
    assert (PackHeader.from_json(unknown.to_json()).prefill_chunks, PackHeader.from_json(unknown.to_json()).built_on) == (None, None)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"prefill_chunks": [0, 5, 5]}, "prefill_chunks[1]"),
        ({"prefill_chunks": [1, 5]}, "prefill_chunks[0]"),
        ({"prefill_chunks": [0, 4]}, "prefill_chunks[1]"),
        ({"prefill_chunks": [0]}, "prefill_chunks"),
        ({"prefill_chunks": [0, 2.0, 5]}, "prefill_chunks[1]"),
        ({"prefill_chunks": None}, "prefill_chunks"),  # unknown is absent, never null
        ({"built_on": {"device": "CUDA", "dtype": "float32"}}, "built_on.device"),
        ({"built_on": {"device": "cpu", "dtype": "float64"}}, "built_on.dtype"),
        ({"built_on": {"device": "cpu"}}, "built_on"),
    ],
)
def test_bad_prefill_records_are_refused(changes: dict, field: str) -> None:
    record = {k: v for k, v in json.loads(encode_pack(make_pack()).header.to_json()).items() if k != "pack_sha256"}
    record.update(changes)
    with pytest.raises(InvalidInput, match=rf"^pack header field '{re.escape(field)}' must"):
        PackHeader.from_json(canonical_json({**record, "pack_sha256": sha256_hex(canonical_json(record))}))


def test_a_splice_records_no_prefill_of_its_text() -> None:
    rope = dataclasses.replace(spliced(), prefill_chunks=(0, 5))
    with pytest.raises(InvalidInput, match="'prefill_chunks' must be absent for a rope composition"):
        rope.validate()
    dataclasses.replace(spliced(), built_on=BUILT_ON).validate()  # where it was spliced is known


def test_bank_lexical_record_round_trips_and_refuses_damage() -> None:
    import numpy as np
    import zstandard

    from packstore.format.bank import LEXICAL_MAGIC, decode_lexical, encode_lexical

    starts = np.array([0, 2, 2, 5], dtype=np.uint32)
    members = {"vocab.index.json": b'{"a": 0}', "data.csc.index.npy": bytes(range(200))}
    decoded_starts, decoded = decode_lexical(encode_lexical(starts, members))
    assert decoded_starts.tolist() == [0, 2, 2, 5] and decoded == members
    record = bytearray(encode_lexical(starts, members))
    record[30] ^= 1
    with pytest.raises(IntegrityError, match="bank lexical index is damaged: checksum"):
        decode_lexical(bytes(record))

    def sealed(body: bytes) -> bytes:
        return body + hashlib.sha256(body).digest()

    preamble = struct.pack("<4sBII", LEXICAL_MAGIC, 1, 1, 1) + struct.pack("<I", 0)
    lying = zstandard.ZstdCompressor().compress(struct.pack("<HQ", 1, 10**6) + b"x")  # a member longer than the record
    with pytest.raises(IntegrityError, match="runs past the record"):
        decode_lexical(sealed(preamble + struct.pack("<Q", 11) + lying))
    with pytest.raises(IntegrityError, match="damaged"):
        decode_lexical(sealed(preamble + struct.pack("<Q", 5) + lying))  # the plain size is wrong


def test_bank_cluster_records_round_trip_with_fp16_and_int8_vectors() -> None:
    import numpy as np

    from packstore.format.bank import Cluster, decode_cluster, encode_cluster, quantize

    vectors = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids, texts = np.array([4, 9, 11], dtype=np.uint32), ["a", "é", ""]
    codes, scales = quantize(vectors)
    halves, quantized = Cluster(ids, vectors.astype(np.float16), texts), Cluster(ids, codes, texts, scales)
    half, quarter = decode_cluster(encode_cluster(halves)), decode_cluster(encode_cluster(quantized))
    assert half.scales is None and quarter.embeddings.dtype == np.int8 and quarter.texts == texts
    assert np.abs(half.vectors() - vectors).max() < 1e-3 and np.abs(quarter.vectors() - vectors).max() < 1e-2
    assert len(encode_cluster(quantized)) == len(encode_cluster(halves)) - 3 * (8 - 2)
    record = bytearray(encode_cluster(quantized))
    record[20] ^= 1
    with pytest.raises(IntegrityError, match="bank cluster is damaged"):
        decode_cluster(bytes(record))
