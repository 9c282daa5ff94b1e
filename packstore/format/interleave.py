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
def _join2(p0, p1, out, offset, count, rotated):  # pragma: no cover - compiled; tested through join_planes
    for a in range(p0.shape[0]):
        for t in range(count):
            for d in range(p0.shape[2]):
                v = np.uint16(p0[a, t, d]) | (np.uint16(p1[a, t, d]) << np.uint16(8))
                if rotated:
                    v = (v >> np.uint16(1)) | ((v & np.uint16(1)) << np.uint16(15))
                out[a, offset + t, d] = v


@njit(nogil=True, cache=True)
def _join4(p0, p1, p2, p3, out, offset, count, rotated):  # pragma: no cover - compiled; tested through join_planes
    for a in range(p0.shape[0]):
        for t in range(count):
            for d in range(p0.shape[2]):
                v = (
                    np.uint32(p0[a, t, d])
                    | (np.uint32(p1[a, t, d]) << np.uint32(8))
                    | (np.uint32(p2[a, t, d]) << np.uint32(16))
                    | (np.uint32(p3[a, t, d]) << np.uint32(24))
                )
                if rotated:
                    v = (v >> np.uint32(1)) | ((v & np.uint32(1)) << np.uint32(31))
                out[a, offset + t, d] = v


def join_planes(planes: list[np.ndarray], out: np.ndarray, offset: int, count: int, rotated: bool) -> None:
    """Write elements ``[:, :count]`` of ``planes`` (uint8, each ``[A, T, D]``: byte j of every element of a tensor)
    to ``out[:, offset : offset + count]`` (C-contiguous ``[A, P, D]`` of uint16 or uint32); ``rotated``: the
    elements were stored rotated left by one bit, so rotate them back."""
    if len(planes) == 2 and out.dtype == np.uint16:
        _join2(planes[0], planes[1], out, offset, count, rotated)
    elif len(planes) == 4 and out.dtype == np.uint32:
        _join4(planes[0], planes[1], planes[2], planes[3], out, offset, count, rotated)
    else:
        raise ValueError(f"cannot join {len(planes)} byte planes into {out.dtype} elements")
