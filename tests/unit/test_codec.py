"""The byte-plane codec: bit-exact on every dtype and odd value, refuses malformed containers, still reads versions 1 and 2."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save

from packstore.errors import IntegrityError
from packstore.format import codec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PREAMBLE = struct.Struct("<4sBBBIQI")


def blob_of(*tensors: torch.Tensor) -> bytes:
    return save({f"t{i}": t.contiguous() for i, t in enumerate(tensors)})


def frame_table(stored: bytes) -> list[tuple[int, int]]:
    _, _, width, transform, _, elements, segment = PREAMBLE.unpack_from(stored)
    count = 1 + (3 if transform == codec.SPLIT_FLOAT16 else width) * -(-elements // segment)
    return [struct.unpack_from("<BI", stored, PREAMBLE.size + 5 * i) for i in range(count)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact_including_special_values(dtype: str) -> None:
    info = torch.finfo(DTYPES[dtype])
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny / 4, info.max, info.min], dtype=DTYPES[dtype])
    gen = torch.Generator().manual_seed(1)
    blob = blob_of(torch.randn(2, 50, 16, generator=gen).to(DTYPES[dtype]), special, -special)
    assert codec.decode(codec.encode(blob, dtype), len(blob)) == blob


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotation_gives_the_exponent_a_plane_of_its_own(dtype: str) -> None:
    """float32 and bfloat16 are rotated left one bit: the last plane is the 8-bit exponent, the sign goes to bit 0."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(4)).to(DTYPES[dtype])
    planes = codec.decode_planes(codec.encode(blob_of(values), dtype), 1 << 20)
    bits = values.view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy().astype(np.int64)
    exponent_shift = 7 if dtype == "bfloat16" else 23
    assert planes.rotated
    assert (planes.plane(planes.element_size - 1) == (bits >> exponent_shift) & 0xFF).all()
    assert (planes.plane(0) & 1 == (bits < 0)).all()


def test_float16_is_split_so_only_sign_and_exponent_are_entropy_coded() -> None:
    """float16's 5-bit exponent fills no byte: plane 1 holds bits 10-15 (sign and exponent), plane 0 the low byte,
    and plane 2 the two top mantissa bits, four elements a byte, a row of 64 elements at one shift."""
    values = torch.randn(3 * 256 + 70, generator=torch.Generator().manual_seed(9)).half()
    planes = codec.decode_planes(codec.encode(blob_of(values), "float16"), 1 << 20)
    bits = values.view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    assert planes.transform == codec.SPLIT_FLOAT16 and not planes.rotated and len(planes.segments) == 3
    assert (planes.plane(0) == bits & 0xFF).all() and (planes.plane(1) == bits >> 10).all()
    packed, first, covered = planes.packed(0, len(values))
    assert first == 0 and covered == len(values) and len(packed) == 3 * 64 + 64
    e = np.arange(len(values))
    assert ((packed[(e // 256) * 64 + e % 64] >> (2 * (e // 64 % 4))) & 3 == (bits >> 8) & 3).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_beats_plain_zstd_on_float_data(dtype: str) -> None:
    blob = blob_of(torch.randn(4, 512, 64, generator=torch.Generator().manual_seed(2)).to(DTYPES[dtype]))
    assert len(codec.encode(blob, dtype)) < len(zstandard.compress(blob, 3))


def test_planes_are_coded_in_segments_and_noise_is_stored_raw_and_read_in_place() -> None:
    noise = torch.randint(-(1 << 31), 1 << 31, (3 * codec.SEGMENT + 5,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    blob = blob_of(*noise.view(torch.float32).split(codec.SEGMENT))  # tensors of 65536 elements and one of 5
    stored = codec.encode(blob, "float32")
    frames = frame_table(stored)
    assert len(frames) == 1 + 4 * 4  # the header, then 4 segments per plane (the last one of 5 elements)
    assert [method for method, _ in frames] == [codec.RAW] * 17  # the header too: a few hundred bytes of JSON
    planes = codec.decode_planes(stored, len(blob))
    assert all(np.shares_memory(segment, np.frombuffer(stored, dtype=np.uint8)) for plane in planes.segments for segment in plane)
    assert codec.decode(stored, len(blob)) == blob


def test_each_segment_takes_huffman_unless_zstd_is_clearly_smaller() -> None:
    """An exponent plane is Huffman-coded (it decodes fastest); a plane of runs (zeros, repeated rows) codes far
    better with zstd's matches, and takes zstd."""
    zeros, noise = torch.zeros(codec.SEGMENT), torch.randn(codec.SEGMENT, generator=torch.Generator().manual_seed(5))
    blob = blob_of(zeros.to(torch.bfloat16), noise.to(torch.bfloat16))
    stored = codec.encode(blob, "bfloat16")
    frames = frame_table(stored)
    zeros_frame, noise_frame = frames[1 + 2], frames[1 + 3]  # the exponent plane's segments
    assert zeros_frame[0] == codec.ZSTD and zeros_frame[1] < 100
    assert noise_frame[0] == codec.HUFFMAN and noise_frame[1] < codec.SEGMENT / 2
    assert codec.decode(stored, len(blob)) == blob


def test_segments_end_at_tensor_boundaries() -> None:
    """A chunk's K and V (here 3 heads x 1024 positions x 64 each) are one segment each, so each has its own
    Huffman tables and a chunk has few frames; tensors of other sizes get the smallest aligned multiple."""
    key, value = (torch.randn(3, 1024, 64, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in (6, 7))
    blob = blob_of(key, value)
    stored = codec.encode(blob, "bfloat16")
    assert PREAMBLE.unpack_from(stored)[-1] == 3 * 1024 * 64
    assert len(frame_table(stored)) == 1 + 2 * 2
    assert codec.decode(stored, len(blob)) == blob
    assert codec.segment_for([3 * 8 * 64, 3 * 8 * 64]) == 43 * 1536  # small tensors: a multiple of their size past 65536
    assert codec.segment_for([100_000, 50_000]) == 100_000
    assert codec.segment_for([8 << 20]) == codec.WRITE_SEGMENT_LIMIT
    assert codec.segment_for([]) == codec.SEGMENT


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tensors_across_segment_boundaries_are_joined(dtype: str) -> None:
    """Containers whose segments do not end at tensor boundaries (writers before, other writers, tensors larger than
    a segment) still read: a tensor spanning segments is joined from their parts (the float16 split's packed bits
    packed again for it); one within a segment is read straight from it."""
    gen = torch.Generator().manual_seed(8)
    key, value = (torch.randn(3, 40, 16, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    blob = blob_of(key, value)
    stored = codec.encode(blob, dtype, segment=700)  # 1,920-element tensors over 700-element segments
    assert codec.decode(stored, len(blob)) == blob
    planes = codec.decode_planes(stored, len(blob))
    assert planes.segment == 700 and len(planes.segments[1]) == 6
    for first, tensor in ((0, key), (key.numel(), value)):
        out = np.zeros((3, 40, 16), dtype=np.uint16)
        planes.write(out, first, (3, 40, 16))
        assert (out == tensor.view(torch.int16).numpy().view(np.uint16)).all()
    assert np.shares_memory(planes.plane(1, 710, 1390), planes.segments[1][1])


def test_empty_tensor_round_trips() -> None:
    blob = blob_of(torch.zeros(0, 4))
    assert codec.decode(codec.encode(blob, "float32"), len(blob)) == blob


def test_token_block_lands_in_its_place_and_only_the_positions_asked() -> None:
    """``Planes.write`` puts a block of positions at an offset of a whole layer, and stops at ``count``."""
    layer = torch.randn(3, 10, 8).to(torch.bfloat16)
    block = layer[:, 4:9]
    planes = codec.decode_planes(codec.encode(blob_of(block), "bfloat16"), 1 << 20)
    out = torch.zeros_like(layer)
    planes.write(out.view(torch.int16).numpy().view(np.uint16), 0, (3, 5, 8), offset=4, count=3)
    assert torch.equal(out[:, 4:7], layer[:, 4:7])
    assert not out[:, :4].any() and not out[:, 7:].any()


@pytest.mark.parametrize("offset, count, out_shape", [(3, 2, (2, 4, 8)), (0, 5, (2, 8, 8)), (0, 4, (3, 4, 8)), (-1, 2, (2, 4, 8))])
def test_a_join_that_does_not_fit_its_target_is_refused(offset: int, count: int, out_shape: tuple[int, int, int]) -> None:
    """The compiled join does not check bounds, so its caller does: positions past the target, more than the block
    holds, or a target of other heads or head size are refused before anything is written."""
    blob = blob_of(torch.randn(2, 4, 8).half())
    planes = codec.decode_planes(codec.encode(blob, "float16"), len(blob))
    with pytest.raises(ValueError, match="cannot join planes"):
        planes.write(np.zeros(out_shape, dtype=np.uint16), 0, (2, 4, 8), offset, count)
    with pytest.raises(ValueError, match="cannot join planes"):
        planes.write(np.zeros((2, 8, 8), dtype=np.uint16)[:, ::2], 0, (2, 4, 8))  # not contiguous


def version_1(blob: bytes, width: int) -> bytes:
    """A container as codec ``byteplane-zstd`` (version 1) wrote it: header and whole planes, each one zstd frame."""
    split = codec.safetensors_split(blob)
    elements = np.frombuffer(blob, dtype=np.uint8, offset=split).reshape(-1, width)
    parts = [blob[:split]] + [np.ascontiguousarray(elements[:, j]).tobytes() for j in range(width)]
    frames = [(codec.ZSTD, zstandard.ZstdCompressor(level=1).compress(p)) for p in parts]
    table = b"".join(struct.pack("<BQQ", method, len(p), len(body)) for (method, body), p in zip(frames, parts))
    return struct.pack("<4sBBB", b"PSBP", 1, width, width + 1) + table + b"".join(body for _, body in frames)


def version_2(blob: bytes, dtype: str, segment: int = 700) -> bytes:
    """A container as codec ``byteplane-zstd-2`` (version 2) wrote it: float32/bfloat16 rotated, float16 not, every
    plane in segments, each a level-1 zstd frame."""
    width = DTYPES[dtype].itemsize
    split = codec.safetensors_split(blob)
    elements = np.frombuffer(blob, dtype=np.dtype(f"<u{width}"), offset=split)
    transform = codec.ROTATE_LEFT_1 if dtype in codec.ROTATED else codec.NO_TRANSFORM
    if transform:
        elements = (elements << 1) | (elements >> (8 * width - 1))
    planes = elements.view(np.uint8).reshape(-1, width)
    parts = [blob[:split]] + [np.ascontiguousarray(planes[s : s + segment, j]).tobytes() for j in range(width) for s in range(0, len(elements), segment)]
    frames = [zstandard.ZstdCompressor(level=1).compress(p) for p in parts]
    table = b"".join(struct.pack("<BI", codec.ZSTD, len(f)) for f in frames)
    return PREAMBLE.pack(b"PSBP", 2, width, transform, split, len(elements), segment) + table + b"".join(frames)


@pytest.mark.parametrize("dtype", DTYPES)
def test_version_1_and_2_containers_still_decode(dtype: str) -> None:
    blob = blob_of(torch.randn(2, 30, 8).to(DTYPES[dtype]), torch.randn(3, 300, 2).to(DTYPES[dtype]))
    old = version_1(blob, DTYPES[dtype].itemsize)
    assert codec.decode(old, len(blob)) == blob
    assert not codec.decode_planes(old, len(blob), version=1).rotated
    two = version_2(blob, dtype)
    assert codec.decode(two, len(blob)) == blob
    assert codec.decode_planes(two, len(blob), version=2).transform == (codec.ROTATE_LEFT_1 if dtype in codec.ROTATED else codec.NO_TRANSFORM)


def test_version_2_containers_cannot_hold_what_version_3_added() -> None:
    """Huffman frames and the float16 split are version 3's: a version-2 container naming them is malformed."""
    blob = blob_of(torch.randn(4, 64).half())
    three = bytearray(codec.encode(blob, "float16"))
    assert three[4] == 3 and three[6] == codec.SPLIT_FLOAT16
    three[4] = 2
    with pytest.raises(IntegrityError, match="version 2 with 2-byte elements, transform 2"):
        codec.decode(bytes(three), len(blob))
    bf16 = bytearray(codec.encode(blob_of(torch.randn(4, 4096).to(torch.bfloat16)), "bfloat16"))
    assert codec.HUFFMAN in [method for method, _ in frame_table(bytes(bf16))]
    bf16[4] = 2
    with pytest.raises(IntegrityError, match="unknown byte-plane frame method 2 .container version 2"):
        codec.decode(bytes(bf16), 1 << 20)


def test_a_container_of_another_version_than_the_packs_codec_is_refused() -> None:
    blob = blob_of(torch.randn(8, 8))
    with pytest.raises(IntegrityError, match="version 3, where the pack's codec has version 1"):
        codec.decode_planes(codec.encode(blob, "float32"), len(blob), version=1)
    with pytest.raises(IntegrityError, match="version 1, where the pack's codec has version 3"):
        codec.decode_planes(version_1(blob, 4), len(blob), version=3)
    with pytest.raises(IntegrityError, match="version 2, where the pack's codec has version 3"):
        codec.decode_planes(version_2(blob, "float32"), len(blob), version=3)


@pytest.mark.parametrize(
    "mangle,message",
    [
        (lambda s: s[:5], "truncated"),
        (lambda s: s[:3], "truncated"),
        (lambda s: b"XXXX" + s[4:], "known version"),
        (lambda s: s[:4] + b"\x07" + s[5:], "known version"),
        (lambda s: s[:6] + b"\x09" + s[7:], "transform 9"),
        (lambda s: s + b"\x00", "length"),
        (lambda s: s[:-1], "length"),
    ],
)
def test_malformed_containers_are_refused(mangle, message) -> None:
    stored = codec.encode(blob_of(torch.randn(8, 8)), "float32")
    with pytest.raises(IntegrityError, match=message):
        codec.decode(mangle(stored), 1 << 20)


def test_corrupt_zstd_frame_is_refused() -> None:
    stored = bytearray(codec.encode(blob_of(torch.zeros(64, 64)), "float32"))
    assert frame_table(bytes(stored))[-1][0] == codec.ZSTD
    stored[-3] ^= 0xFF  # inside the last (highly compressed) plane frame
    with pytest.raises(IntegrityError):
        codec.decode(bytes(stored), 1 << 20)


def test_corrupt_huffman_frame_is_refused_naming_the_frame() -> None:
    blob = blob_of(torch.randn(4, 4096, generator=torch.Generator().manual_seed(10)))
    stored = bytearray(codec.encode(blob, "float32"))
    table = frame_table(bytes(stored))
    assert table[-1][0] == codec.HUFFMAN
    start = len(stored) - table[-1][1]
    stored[start + 1] = 0  # the frame now lists one code length: not a complete code
    with pytest.raises(IntegrityError, match=rf"code lengths do not form a complete prefix code of at most 11 bits \(frame {len(table) - 1}\)"):
        codec.decode(bytes(stored), 1 << 20)


def test_declared_lengths_beyond_the_cap_are_refused_before_decompressing() -> None:
    """A container that claims 1 Ti elements must not make the reader allocate them."""
    container = PREAMBLE.pack(b"PSBP", 2, 4, 0, 0, 1 << 40, codec.SEGMENT)
    with pytest.raises(IntegrityError, match="declares 4398046511104 plain bytes, more than the 8192 allowed"):
        codec.decode(container, 8192)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 4096)
    old = struct.pack("<4sBBB", b"PSBP", 1, 2, 3) + struct.pack("<BQQ", 1, 1 << 40, len(frame)) + struct.pack("<BQQ", 0, 0, 0) * 2 + frame
    with pytest.raises(IntegrityError, match="declares 1099511627776 plain bytes"):
        codec.decode(old, 8192)
    blob = blob_of(torch.randn(8, 8))
    with pytest.raises(IntegrityError, match="more than"):
        codec.decode(codec.encode(blob, "float32"), len(blob) - 1)
