"""The byte-plane codec: bit-exact on every dtype and odd value, refuses malformed containers."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard
from safetensors.torch import save

from packstore.errors import IntegrityError
from packstore.format import codec


def blob_of(*tensors: torch.Tensor) -> bytes:
    return save({f"t{i}": t.contiguous() for i, t in enumerate(tensors)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact_including_special_values(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny / 4, info.max, info.min], dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    blob = blob_of(torch.randn(2, 50, 16, generator=gen).to(dtype), special)
    assert codec.decode(codec.encode(blob, special.element_size()), len(blob)) == blob


def test_beats_plain_zstd_on_float_data() -> None:
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        blob = blob_of(torch.randn(4, 512, 64, generator=gen).to(dtype))
        assert len(codec.encode(blob, 2 if dtype == torch.bfloat16 else 4)) < len(zstandard.compress(blob, 3))


def test_incompressible_planes_are_stored_raw() -> None:
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    blob = blob_of(noise)
    stored = codec.encode(blob, 1)
    method, plain_len, stored_len = struct.unpack_from("<BQQ", stored, 7 + 17)  # frame 1: the only plane
    assert method == codec.RAW and plain_len == stored_len == 4096
    assert codec.decode(stored, len(blob)) == blob


def test_empty_tensor_round_trips() -> None:
    blob = blob_of(torch.zeros(0, 4))
    assert codec.decode(codec.encode(blob, 4), len(blob)) == blob


@pytest.mark.parametrize(
    "mangle,message",
    [
        (lambda s: s[:5], "truncated"),
        (lambda s: b"XXXX" + s[4:], "known version"),
        (lambda s: s + b"\x00", "length"),
        (lambda s: s[:-1], "length"),
    ],
)
def test_malformed_containers_are_refused(mangle, message) -> None:
    stored = codec.encode(blob_of(torch.randn(8, 8)), 4)
    with pytest.raises(IntegrityError, match=message):
        codec.decode(mangle(stored), 1 << 20)


def test_corrupt_zstd_frame_is_refused() -> None:
    stored = bytearray(codec.encode(blob_of(torch.zeros(64, 64)), 4))
    stored[-3] ^= 0xFF  # inside the last (highly compressed) plane frame
    with pytest.raises(IntegrityError):
        codec.decode(bytes(stored), 1 << 20)


def test_declared_lengths_beyond_the_cap_are_refused_before_decompressing() -> None:
    """A frame without a content size that claims 1 TiB used to make the reader allocate it."""
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 4096)
    container = struct.pack("<4sBBB", b"PSBP", 1, 1, 2) + struct.pack("<BQQ", 1, 1 << 40, len(frame)) + struct.pack("<BQQ", 0, 0, 0) + frame
    with pytest.raises(IntegrityError, match="declares 1099511627776 plain bytes, more than the 8192 allowed"):
        codec.decode(container, 8192)
    blob = blob_of(torch.randn(8, 8))
    with pytest.raises(IntegrityError, match="more than"):
        codec.decode(codec.encode(blob, 4), len(blob) - 1)
