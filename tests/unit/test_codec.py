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
    assert codec.decode(codec.encode(blob, special.element_size())) == blob


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
    assert codec.decode(stored) == blob


def test_empty_tensor_round_trips() -> None:
    blob = blob_of(torch.zeros(0, 4))
    assert codec.decode(codec.encode(blob, 4)) == blob


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
        codec.decode(mangle(stored))


def test_corrupt_zstd_frame_is_refused() -> None:
    stored = bytearray(codec.encode(blob_of(torch.zeros(64, 64)), 4))
    stored[-3] ^= 0xFF  # inside the last (highly compressed) plane frame
    with pytest.raises(IntegrityError):
        codec.decode(bytes(stored))
