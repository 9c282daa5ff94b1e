"""Byte planes joined into elements by torch, on the device the elements are to live on.

The CPU's join (``packstore.format.interleave``) is the reference and the default. On a GPU host the CPU threads are
what caps delivery (the decoding threads are slower than the pinned copy: docs/benchmarks.md, "GPU path"), and the
join is their largest pass after entropy decoding: with ``HostBuffers(join_on_device=True)`` the CPU only checks,
entropy-decodes and stages a chunk's planes, the copy carries the planes, and the device puts the elements together
here, bit for bit what the CPU's kernels write (tests/unit/test_plane_join.py).
"""

from __future__ import annotations

import torch

from packstore.format.interleave import check_join, packed_index

_SIGNED = {16: torch.int16, 32: torch.int32}  # element bits -> the integers an element's bytes are viewed as


def join_planes_on(
    planes: list[torch.Tensor],
    shape: tuple[int, int, int],
    out: torch.Tensor,
    offset: int,
    count: int,
    rotated: bool,
    packed: tuple[torch.Tensor, int, int] | None = None,
) -> None:
    """``format.interleave.join_planes`` in torch ops on ``out``'s device: write elements ``[:, :count]`` of
    ``planes`` (uint8, each byte j of every element of an ``[A, T, D]`` ``shape``) to ``out[:, offset : offset +
    count]`` (an ``[A, P, D]`` tensor of 2- or 4-byte elements); ``rotated``: undo the codec's rotation; with
    ``packed`` (the packed plane, the element there of the tensor's first, the elements it covers), ``planes`` are
    the float16 split's low byte and bits 10-15."""
    heads, rows, width = shape
    elements = heads * rows * width
    bits = 8 * out.element_size()
    sizes = [p.numel() for p in planes]
    check_join(sizes, shape, tuple(out.shape), offset, count, out.is_contiguous(), packed and (len(packed[0]), *packed[1:]))
    if len(planes) != (2 if packed is not None else bits // 8) or bits not in _SIGNED or any(p.dtype != torch.uint8 for p in planes):
        raise ValueError(f"cannot join {len(planes)} byte planes into {out.dtype} elements")
    if packed is not None:
        plane, first, _ = packed
        byte, shift = packed_index(torch.arange(first, first + elements, device=out.device))
        top = (plane[byte].to(torch.int32) >> shift) & 3
        value = (planes[1].to(torch.int32) << 10) | (top << 8) | planes[0].to(torch.int32)
    else:
        value = planes[0].to(torch.int64)
        for j, plane_j in enumerate(planes[1:], start=1):
            value |= plane_j.to(torch.int64) << (8 * j)
        if rotated:
            value = (value >> 1) | ((value & 1) << (bits - 1))
    joined = value.to(_SIGNED[bits]).view(heads, rows, width)[:, :count]  # narrowing keeps the low bits
    out.view(_SIGNED[bits])[:, offset : offset + count].copy_(joined)
