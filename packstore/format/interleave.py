"""Compiled kernels that put a chunk's byte planes back together into elements, in one pass.

Joining planes with numpy takes one pass over memory per byte plane plus a cast, and undoing the
codec's rotation (sign bit stored as bit 0, docs/format.md §1.4) three more: the join was the
largest serial cost of reading a pack. These numba kernels read each plane byte once and write
each element once, straight into its place in a layer's tensor, with the GIL released so chunks
decode in parallel threads. The float16 split (container version 3) keeps each element's two top
mantissa bits in a packed plane, four elements a byte, laid out so that 64 consecutive elements read
64 consecutive bytes at one shift (``packed_index``): its join vectorizes like the others.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
from numba import njit

IntArray = TypeVar("IntArray", bound=Any)  # numpy or torch integers: the packed layout is the same on either side


@njit(nogil=True, cache=True)
def _join2(
    p0: np.ndarray, p1: np.ndarray, out: np.ndarray,
    heads: int, rows: int, width: int, positions: int, offset: int, count: int, rotated: bool,
) -> None:  # pragma: no cover - compiled; tested through join_planes
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
def _join4(
    p0: np.ndarray, p1: np.ndarray, p2: np.ndarray, p3: np.ndarray, out: np.ndarray,
    heads: int, rows: int, width: int, positions: int, offset: int, count: int, rotated: bool,
) -> None:  # pragma: no cover - compiled
    run = count * width
    for a in range(heads):
        src, dst = a * rows * width, (a * positions + offset) * width
        b0, b1, b2, b3 = p0[src : src + run], p1[src : src + run], p2[src : src + run], p3[src : src + run]
        to = out[dst : dst + run]
        for i in range(run):
            v = (
                np.uint32(b0[i])
                | (np.uint32(b1[i]) << np.uint32(8))
                | (np.uint32(b2[i]) << np.uint32(16))
                | (np.uint32(b3[i]) << np.uint32(24))
            )
            if rotated:
                v = (v >> np.uint32(1)) | ((v & np.uint32(1)) << np.uint32(31))
            to[i] = v


PACKED_GROUP = 256  # elements whose top mantissa bits share 64 bytes of the packed plane


@njit(nogil=True, cache=True)
def packed_length(elements: int) -> int:
    """Bytes of the packed plane of ``elements`` elements: 64 per whole group of 256, then one per element of the
    last group's first row of 64."""
    return (elements // PACKED_GROUP) * 64 + min(elements % PACKED_GROUP, 64)


def packed_index(element: IntArray) -> tuple[IntArray, IntArray]:
    """Where element ``e``'s two bits are in the packed plane: byte ``(e // 256) * 64 + e % 64``, at bit ``2 * (e // 64 % 4)``
    (``element``: integer indices, a numpy array or a torch tensor)."""
    return (element >> 8) * 64 + (element & 63), 2 * ((element >> 6) & 3)


def pack_pairs(values: np.ndarray) -> np.ndarray:
    """The packed plane of 2-bit ``values`` (uint8, one per element)."""
    groups = -(-len(values) // PACKED_GROUP)
    padded = np.zeros(groups * PACKED_GROUP, np.uint8)
    padded[: len(values)] = values
    rows = padded.reshape(groups, 4, 64)
    packed = rows[:, 0] | (rows[:, 1] << 2) | (rows[:, 2] << 4) | (rows[:, 3] << 6)
    return packed.reshape(-1)[: packed_length(len(values))]


def unpack_pairs(packed: np.ndarray, elements: int) -> np.ndarray:
    """The 2-bit values (one uint8 per element) of a packed plane of ``elements`` elements."""
    byte, shift = packed_index(np.arange(elements))
    values: np.ndarray = (packed[byte] >> shift.astype(np.uint8)) & 3
    return values


@njit(nogil=True, cache=True, inline="always")
def _split_row(
    b0: np.ndarray, b1: np.ndarray, b2: np.ndarray, shift: np.uint8, to: np.ndarray, count: int
) -> None:  # pragma: no cover - compiled
    """``count`` float16 of one packed row: consecutive bytes of every plane, one shift."""
    for t in range(count):
        to[t] = (np.uint16(b1[t]) << np.uint16(10)) | (np.uint16((b2[t] >> shift) & np.uint8(3)) << np.uint16(8)) | np.uint16(b0[t])


@njit(nogil=True, cache=True)
def _join_split(
    p0: np.ndarray, p1: np.ndarray, packed: np.ndarray, packed_at: int, out: np.ndarray,
    heads: int, rows: int, width: int, positions: int, offset: int, count: int,
) -> None:  # pragma: no cover - compiled
    """float16 from its low byte (``p0``), sign and exponent (``p1``: bits 10-15) and top mantissa bits (``packed``,
    element i of ``p0`` being element ``packed_at + i`` there)."""
    run = count * width
    for a in range(heads):
        src, dst = a * rows * width, (a * positions + offset) * width
        i = 0
        while i < run:
            e = packed_at + src + i
            if e % PACKED_GROUP == 0 and run - i >= PACKED_GROUP:  # a whole group: its 4 rows share 64 packed bytes
                b2 = packed[(e >> 8) * 64 : (e >> 8) * 64 + 64]
                for r in range(4):
                    at = i + 64 * r
                    low, high = p0[src + at : src + at + 64], p1[src + at : src + at + 64]
                    _split_row(low, high, b2, np.uint8(2 * r), out[dst + at : dst + at + 64], 64)
                i += PACKED_GROUP
                continue
            take = min(run - i, 64 - (e & 63))  # else a row (or its part) at a time
            at = (e >> 8) * 64 + (e & 63)
            low, high = p0[src + i : src + i + take], p1[src + i : src + i + take]
            _split_row(low, high, packed[at : at + take], np.uint8(2 * ((e >> 6) & 3)), out[dst + i : dst + i + take], take)
            i += take


def check_join(
    sizes: list[int], shape: tuple[int, int, int], out_shape: tuple[int, ...], offset: int, count: int, contiguous: bool,
    packed: tuple[int, int, int] | None = None,
) -> None:
    """ValueError unless planes of ``sizes`` bytes (and a packed plane of ``packed``: its length, the element there of
    the tensor's first, the elements it covers) hold an ``[A, T, D]`` ``shape`` whose ``[:, :count]`` fits positions
    ``offset`` onwards of a contiguous ``[A, P, D]`` output: the checks every join (CPU or device) makes first."""
    heads, rows, width = shape
    elements = heads * rows * width
    fits = len(out_shape) == 3 and out_shape[0] == heads and out_shape[2] == width and 0 <= count <= rows
    fits = fits and 0 <= offset <= out_shape[1] - count and contiguous and all(size == elements for size in sizes)
    if packed is not None:
        length, first, covered = packed
        fits = fits and 0 <= first and first + elements <= covered and length == packed_length(covered)
    if not fits:
        where = f"positions {offset} .. {offset + count} of {tuple(out_shape)}"
        raise ValueError(f"cannot join planes of {sizes} bytes as {shape} into {where}")


def join_planes(
    planes: list[np.ndarray],
    shape: tuple[int, int, int],
    out: np.ndarray,
    offset: int,
    count: int,
    rotated: bool,
    packed: tuple[np.ndarray, int, int] | None = None,
) -> None:
    """Write elements ``[:, :count]`` of ``planes`` (uint8, each the flat bytes of an ``[A, T, D]`` ``shape``: byte j
    of every element of a tensor) to ``out[:, offset : offset + count]`` (C-contiguous ``[A, P, D]`` of uint16 or
    uint32); ``rotated``: the elements were stored rotated left by one bit, so rotate them back. With ``packed``
    (the packed plane, the element there of the tensor's first, and the elements it covers), ``planes`` are a
    float16's low byte and its bits 10-15 (the float16 split). Each head's positions are one run of memory on
    both sides, so the kernels copy runs rather than rows."""
    heads, rows, width = shape
    check_join([len(p) for p in planes], shape, out.shape, offset, count, out.flags.c_contiguous, packed and (len(packed[0]), *packed[1:]))
    dims = (heads, rows, width, out.shape[1], offset, count)
    if packed is not None and len(planes) == 2 and out.dtype == np.uint16:
        _join_split(planes[0], planes[1], packed[0], packed[1], out.reshape(-1), *dims)
    elif len(planes) == 2 and out.dtype == np.uint16:
        _join2(planes[0], planes[1], out.reshape(-1), *dims, rotated)
    elif len(planes) == 4 and out.dtype == np.uint32:
        _join4(planes[0], planes[1], planes[2], planes[3], out.reshape(-1), *dims, rotated)
    else:
        raise ValueError(f"cannot join {len(planes)} byte planes into {out.dtype} elements")
