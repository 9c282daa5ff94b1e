"""Byte planes joined by torch on the elements' device (``packs.plane_join``, ``HostBuffers(join_on_device=True)``):
bit for bit what the CPU's compiled join writes, for every codec transform, token block and prefix. On the CPU
here, and on CUDA where it exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packstore.format.interleave import join_planes, pack_pairs, packed_length
from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.plane_join import join_planes_on
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.helpers.packs import make_pack

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


@pytest.mark.parametrize("width,rotated", [(2, True), (2, False), (4, True), (4, False)])
def test_joined_planes_equal_the_compiled_join(width: int, rotated: bool) -> None:
    rng = np.random.default_rng(width + rotated)
    shape, positions, offset, count = (3, 70, 16), 100, 20, 61
    planes = [rng.integers(0, 256, int(np.prod(shape)), dtype=np.uint8) for _ in range(width)]  # every bit pattern, signs included
    unsigned = {2: np.uint16, 4: np.uint32}[width]
    expected = np.zeros((3, positions, 16), unsigned)
    join_planes(planes, shape, expected, offset, count, rotated)
    out = torch.zeros((3, positions, 16), dtype={2: torch.bfloat16, 4: torch.float32}[width])
    join_planes_on([torch.from_numpy(p) for p in planes], shape, out, offset, count, rotated)
    assert np.array_equal(out.view({2: torch.int16, 4: torch.int32}[width]).numpy().view(unsigned), expected)


def test_the_float16_split_joins_from_its_packed_plane() -> None:
    rng = np.random.default_rng(7)
    shape, covered, first = (2, 40, 8), 1000, 300  # the tensor starts mid-group in its segment's packed plane
    elements = int(np.prod(shape))
    low, high = rng.integers(0, 256, elements, dtype=np.uint8), rng.integers(0, 64, elements, dtype=np.uint8)
    packed = pack_pairs(rng.integers(0, 4, covered, dtype=np.uint8))
    assert len(packed) == packed_length(covered)
    expected = np.zeros((2, 40, 8), np.uint16)
    join_planes([low, high], shape, expected, 0, 40, False, (packed, first, covered))
    out = torch.zeros((2, 40, 8), dtype=torch.float16)
    join_planes_on([torch.from_numpy(low), torch.from_numpy(high)], shape, out, 0, 40, False, (torch.from_numpy(packed), first, covered))
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), expected)


def test_planes_that_do_not_fit_the_tensor_are_refused() -> None:
    out = torch.zeros((2, 8, 4), dtype=torch.bfloat16)
    planes = [torch.zeros(2 * 8 * 4, dtype=torch.uint8)] * 2
    with pytest.raises(ValueError, match="cannot join"):
        join_planes_on(planes, (2, 8, 4), out, 4, 8, True)  # positions 4 .. 12 of 8
    with pytest.raises(ValueError, match="cannot join"):
        join_planes_on(planes[:1], (2, 8, 4), out, 0, 8, True)  # a bfloat16 has two planes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_packs_joined_on_the_device_are_bit_for_bit_the_cpu_decode(tmp_path, device: str, dtype: str) -> None:
    pack = make_pack(dtype=dtype, layers=4, tokens=300, heads=2, dim=32)
    encoded = encode_pack(pack, block_positions=64)
    buffers = HostBuffers(staging_bytes=200 << 10, join_on_device=True)  # smaller than a pack: staging blocks are reused
    with LmdbStore(tmp_path / "store") as store, Decoder(workers=3, buffers=buffers) as decoder:
        key, _ = store.put(encoded)
        reader = PackReader(store, decoder)
        whole = reader.fetch(key, device=device)
        arriving = reader.start_fetch(key, device=device)
        layers = [arriving.layer(slot) for slot in range(4)]
        part = reader.fetch_part(key, layers=(1, 2), prefix=100, device=device)
        decoded = decode_pack(encoded, device, decoder=decoder)
    assert all(t.device.type == device for t in whole.keys + whole.values)
    for got in (whole, decoded):
        assert same(got.keys, pack.keys) and same(got.values, pack.values)
    assert same([k for k, _ in layers], pack.keys) and same([v for _, v in layers], pack.values)
    assert same(part.keys, [k[:, :100] for k in pack.keys[1:3]]) and same(part.values, [v[:, :100] for v in pack.values[1:3]])
