"""Compiled kernels that put a chunk's byte planes back together into elements, in one pass.

Joining planes with numpy takes one pass over memory per byte plane plus a cast, and undoing the
codec's rotation (sign bit stored as bit 0, docs/format.md §1.4) three more: the join was the
largest serial cost of reading a pack. These numba kernels read each plane byte once and write
each element once, straight into its place in a layer's tensor, with the GIL released so chunks
decode in parallel threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def _join2(p0, p1, out, heads, rows, width, positions, offset, count, rotated):  # pragma: no cover - compiled; tested through join_planes
    run = count * width  # each head's positions are one run in both arrays
    for a in range(heads):
        src, dst = a * rows * width, (a * positions + offset) * width
        b0, b1, to = p0[src : src + run], p1[src : src + run], out[dst : dst + run]  # loop indices then need no sign checks
        for i in range(run):
            v = np.uint16(b0[i]) | (np.uint16(b1[i]) << np.uint16(8))
            if rotated:
                v = (v >> np.uint16(1)) | ((v & np.uint16(1)) << np.uint16(15))
            to[i] = v


@njit(nogil=True, cache=True)
def _join4(p0, p1, p2, p3, out, heads, rows, width, positions, offset, count, rotated):  # pragma: no cover - compiled; tested through join_planes
    run = count * width
    for a in range(heads):
        src, dst = a * rows * width, (a * positions + offset) * width
        b0, b1, b2, b3 = p0[src : src + run], p1[src : src + run], p2[src : src + run], p3[src : src + run]
        to = out[dst : dst + run]
        for i in range(run):
            v = np.uint32(b0[i]) | (np.uint32(b1[i]) << np.uint32(8)) | (np.uint32(b2[i]) << np.uint32(16)) | (np.uint32(b3[i]) << np.uint32(24))
            if rotated:
                v = (v >> np.uint32(1)) | ((v & np.uint32(1)) << np.uint32(31))
            to[i] = v


def join_planes(planes: list[np.ndarray], shape: tuple[int, int, int], out: np.ndarray, offset: int, count: int, rotated: bool) -> None:
    """Write elements ``[:, :count]`` of ``planes`` (uint8, each the flat bytes of an ``[A, T, D]`` ``shape``: byte j
    of every element of a tensor) to ``out[:, offset : offset + count]`` (C-contiguous ``[A, P, D]`` of uint16 or
    uint32); ``rotated``: the elements were stored rotated left by one bit, so rotate them back. Each head's
    positions are one run of memory on both sides, so the kernels copy runs rather than rows."""
    heads, rows, width = shape
    fits = out.ndim == 3 and out.shape[0] == heads and out.shape[2] == width and 0 <= count <= rows and 0 <= offset <= out.shape[1] - count
    if not (fits and out.flags.c_contiguous and all(len(plane) == heads * rows * width for plane in planes)):
        raise ValueError(f"cannot join planes of {[len(p) for p in planes]} bytes as {shape} into positions {offset} .. {offset + count} of {out.shape}")
    dims = (heads, rows, width, out.shape[1], offset, count, rotated)
    if len(planes) == 2 and out.dtype == np.uint16:
        _join2(planes[0], planes[1], out.reshape(-1), *dims)
    elif len(planes) == 4 and out.dtype == np.uint32:
        _join4(planes[0], planes[1], planes[2], planes[3], out.reshape(-1), *dims)
    else:
        raise ValueError(f"cannot join {len(planes)} byte planes into {out.dtype} elements")
