"""The compiled encoder (issue 36): bit-exact round trips on any bit pattern and size, and the very bytes the
numpy encoder before it wrote (kept here as the reference), so packs are stored exactly as before, only faster."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save

from packstore.format import codec, huffman
from packstore.format.interleave import pack_pairs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BITS = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}


def blob_of(*tensors: torch.Tensor) -> bytes:
    return save({f"t{i}": t.contiguous() for i, t in enumerate(tensors)})


def reference_encode(blob: bytes, dtype: str, segment: int | None = None) -> bytes:
    """The encoder as it was before issue 36, in numpy: every segment Huffman- and zstd-coded, the smaller kept."""
    width = codec.DTYPE_SIZES[dtype]
    split = codec.safetensors_split(blob)
    elements = np.frombuffer(blob, dtype=np.dtype(f"<u{width}"), offset=split)
    if segment is None:
        segment = codec.segment_for([(t.stop - t.start) // width for t in codec.tensor_table(blob)])
    transform = codec.transform_for(dtype)
    if transform == codec.SPLIT_FLOAT16:
        planes = [(elements & 0xFF).astype(np.uint8), (elements >> 10).astype(np.uint8), ((elements >> 8) & 3).astype(np.uint8)]
    else:
        rotated = (elements << 1) | (elements >> (8 * width - 1))
        as_bytes = rotated.view(np.uint8).reshape(-1, width)
        planes = [np.ascontiguousarray(as_bytes[:, j]) for j in range(width)]
    compressor = zstandard.ZstdCompressor(level=1)
    frames = [(codec.RAW, bytes(blob[:split]))]
    for j, plane in enumerate(planes):
        for s in range(0, len(plane), segment):
            part = pack_pairs(plane[s : s + segment]) if transform == codec.SPLIT_FLOAT16 and j == 2 else plane[s : s + segment]
            method, coded = codec.HUFFMAN, huffman.encode(part)
            matched = compressor.compress(part.tobytes())
            if len(matched) <= codec.ZSTD_PREFERENCE * len(coded):
                method, coded = codec.ZSTD, matched
            if len(coded) >= codec.RAW_THRESHOLD * len(part):
                method, coded = codec.RAW, part.tobytes()
            frames.append((method, coded))
    preamble = codec._PREAMBLE.pack(codec.MAGIC, codec.VERSION, width, transform, split, len(elements), segment)
    table = b"".join(codec._ENTRY.pack(method, len(body)) for method, body in frames)
    return b"".join([preamble, table] + [body for _, body in frames])


def kv_like(dtype: str, heads: int = 3, positions: int = 1024, dim: int = 64, repeats: bool = False, seed: int = 0) -> bytes:
    """A chunk like a layer's K and V: per-head scales on Gaussian values; with ``repeats``, V's rows repeat as a first
    layer's do (its values depend on the token alone, and tokens recur), which zstd's matches win on."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(heads, positions, dim, generator=gen) * torch.rand(heads, 1, dim, generator=gen) * 4
    if repeats:
        table = torch.randn(heads, 50, dim, generator=gen)
        value = table[:, torch.randint(0, 50, (positions,), generator=gen)]
    else:
        value = torch.randn(heads, positions, dim, generator=gen)
    return blob_of(key.to(DTYPES[dtype]), value.to(DTYPES[dtype]))


def bit_patterns(dtype: str, count: int, seed: int) -> torch.Tensor:
    """``count`` elements of uniformly random bits: every NaN payload, infinities, subnormals and signed zeros alike."""
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max + 1, (count,), dtype=bits, generator=torch.Generator().manual_seed(seed)).view(DTYPES[dtype])


def specials(dtype: str) -> torch.Tensor:
    info = torch.finfo(DTYPES[dtype])
    values = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), info.tiny / 4, info.max, info.min, info.eps]
    return torch.tensor(values, dtype=DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 3, 63, 255, 257, 4099, 70_001])
def test_any_bits_round_trip_exactly_and_as_before(dtype: str, count: int) -> None:
    blob = blob_of(bit_patterns(dtype, count, count), specials(dtype))
    stored = codec.encode(blob, dtype)
    assert bytes(codec.decode(stored, len(blob))) == blob
    assert stored == reference_encode(blob, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("segment", [1, 7, 700, 65_536])
def test_odd_segments_round_trip_exactly_and_as_before(dtype: str, segment: int) -> None:
    gen = torch.Generator().manual_seed(segment)
    blob = blob_of(torch.randn(3, 40, 17, generator=gen).to(DTYPES[dtype]), specials(dtype), torch.zeros(300, dtype=DTYPES[dtype]))
    stored = codec.encode(blob, dtype, segment=segment)
    assert bytes(codec.decode(stored, len(blob))) == blob
    assert stored == reference_encode(blob, dtype, segment)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fill", [0.0, 1.0, float("nan"), float("-inf")])
def test_constant_tensors_take_zstd_as_before(dtype: str, fill: float) -> None:
    """A run is what zstd's matches win on: the probe must find it, whatever its value."""
    blob = blob_of(torch.full((2, 300, 64), fill, dtype=DTYPES[dtype]), torch.full((5,), fill, dtype=DTYPES[dtype]))
    stored = codec.encode(blob, dtype)
    assert bytes(codec.decode(stored, len(blob))) == blob
    assert stored == reference_encode(blob, dtype)
    assert len(stored) < len(blob) / 50


def test_empty_tensors_encode_as_before() -> None:
    blob = blob_of(torch.zeros(0, 4, dtype=torch.bfloat16))
    assert codec.encode(blob, "bfloat16") == reference_encode(blob, "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("repeats", [False, True])
def test_kv_like_chunks_are_stored_as_before(dtype: str, repeats: bool) -> None:
    """Chunks like real KV, with a first layer's repeated rows (zstd wins on V's planes) and without (it is never
    tried, and would not have won): the same frames, methods and bytes as the encoder that tried it everywhere."""
    blob = kv_like(dtype, repeats=repeats, seed=3)
    stored = codec.encode(blob, dtype)
    assert stored == reference_encode(blob, dtype)
    assert bytes(codec.decode(stored, len(blob))) == blob
    methods = {method for method, _ in iter_frames(stored)}
    assert (codec.ZSTD in methods) is repeats


def iter_frames(stored: bytes) -> list[tuple[int, int]]:
    _, _, width, transform, _, elements, segment = codec._PREAMBLE.unpack_from(stored)
    count = 1 + (3 if transform == codec.SPLIT_FLOAT16 else width) * -(-elements // segment)
    return [codec._ENTRY.unpack_from(stored, codec._PREAMBLE.size + codec._ENTRY.size * i) for i in range(count)]


# sha256 of what the encoder before issue 36 (commit e0ddb02) wrote for kv_like(dtype, repeats=True, seed=11).
BEFORE = {
    "float32": "70118210e1abcada6575b2171b14b054a7ffb4f922413506f05a781be2a29ead",
    "float16": "fee4c807e4f1db02816b5d781514cfcb064e7b677579e516236af3e09ce915ac",
    "bfloat16": "6f16e45e948b84170d64b04114ad6dfae6d219cbec5f5a1bc44e5d7888ef6d3a",
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bytes_are_those_the_encoder_before_wrote(dtype: str) -> None:
    assert hashlib.sha256(codec.encode(kv_like(dtype, repeats=True, seed=11), dtype)).hexdigest() == BEFORE[dtype]


def test_chunks_encode_in_parallel_threads_alike() -> None:
    """Each thread has its own compressor and buffers: chunks coded at once on several threads come out as alone."""
    blobs = [kv_like("bfloat16", repeats=seed % 2 == 0, seed=seed) for seed in range(8)]
    alone = [codec.encode(blob, "bfloat16") for blob in blobs]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda blob: codec.encode(blob, "bfloat16"), blobs * 2)) == alone * 2
