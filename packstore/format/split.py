"""Compiled kernels that split a chunk's elements into byte planes and survey them, for the encoder.

The encoder used to split planes with numpy (a pass per plane, holding the GIL between passes), then code every
segment twice, as a Huffman frame and as a zstd frame, to keep the smaller: most of it spent on mantissa planes
that end up stored raw. These kernels split in one pass, and per segment count its bytes (per Huffman stream, so
the Huffman frame's exact size is known before it is written) and probe it for repeats (only then can zstd's matches
win); all with the GIL released, so chunks encode in parallel threads. See ``packstore.format.codec.encode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from packstore.format import huffman
from packstore.format.huffman import _Codegen, _load_u64
from packstore.format.interleave import PACKED_GROUP, packed_length

if TYPE_CHECKING:
    from numba.core.typing import Signature

_ANCHOR_HASH = np.uint32(0x9E3779B1)  # Fibonacci hashing of the 4 bytes at a position decides whether it is an anchor
_ANCHOR_BELOW = np.uint32(1 << 27)  # one position in 32 (by content, so at the same place in every copy of a run of bytes)
_SLOT_HASH = np.uint64(0x9E3779B97F4A7C15)
_SLOT_BITS = 12  # anchors remembered by their 8 bytes' hash: further back than zstd level 1's own table reaches
MIN_REPEAT = 16  # shorter repeats of a low-entropy plane's bytes are common by chance, and gain zstd little


@njit(nogil=True, cache=True)
def split_rotated2(elements: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:  # pragma: no cover - compiled
    """The two byte planes of 16-bit ``elements`` rotated left one bit."""
    for i in range(len(elements)):
        v = (elements[i] << np.uint16(1)) | (elements[i] >> np.uint16(15))
        low[i] = np.uint8(v & np.uint16(0xFF))
        high[i] = np.uint8(v >> np.uint16(8))


@njit(nogil=True, cache=True)
def split_rotated4(elements: np.ndarray, p0: np.ndarray, p1: np.ndarray, p2: np.ndarray, p3: np.ndarray) -> None:  # pragma: no cover
    """The four byte planes of 32-bit ``elements`` rotated left one bit."""
    for i in range(len(elements)):
        v = (elements[i] << np.uint32(1)) | (elements[i] >> np.uint32(31))
        p0[i] = np.uint8(v & np.uint32(0xFF))
        p1[i] = np.uint8((v >> np.uint32(8)) & np.uint32(0xFF))
        p2[i] = np.uint8((v >> np.uint32(16)) & np.uint32(0xFF))
        p3[i] = np.uint8(v >> np.uint32(24))


@njit(nogil=True, cache=True)
def _pairs(elements: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Bits 8-9 of float16 ``elements`` (uint8, one per element)."""
    out = np.empty(len(elements), np.uint8)
    for i in range(len(elements)):
        out[i] = np.uint8((elements[i] >> np.uint16(8)) & np.uint16(3))
    return out


@njit(nogil=True, cache=True)
def split_float16(elements: np.ndarray, segment: int, low: np.ndarray, high: np.ndarray, packed: np.ndarray) -> None:  # pragma: no cover
    """The float16 split: the low bytes, bits 10-15, and bits 8-9 packed per segment of ``segment`` elements
    (``interleave.packed_index``), segment k's from ``packed[k * packed_length(segment)]``."""
    for i in range(len(elements)):
        low[i] = np.uint8(elements[i] & np.uint16(0xFF))
        high[i] = np.uint8(elements[i] >> np.uint16(10))
    stride = packed_length(segment)
    for k in range((len(elements) + segment - 1) // segment):
        pairs = _pairs(elements[k * segment : (k + 1) * segment])
        out = packed[k * stride : k * stride + packed_length(len(pairs))]
        whole = len(pairs) // PACKED_GROUP
        for g in range(whole):  # a group's 256 elements share 64 bytes, row r at bits 2r
            r0, r1 = pairs[g * 256 : g * 256 + 64], pairs[g * 256 + 64 : g * 256 + 128]
            r2, r3, to = pairs[g * 256 + 128 : g * 256 + 192], pairs[g * 256 + 192 : g * 256 + 256], out[g * 64 : g * 64 + 64]
            for b in range(64):
                to[b] = r0[b] | (r1[b] << np.uint8(2)) | (r2[b] << np.uint8(4)) | (r3[b] << np.uint8(6))
        for b in range(len(out) - whole * 64):  # the last group's first row, and the rows after it where they reach
            byte = np.uint8(0)
            for r in range(4):
                e = whole * PACKED_GROUP + b + 64 * r
                if e < len(pairs):
                    byte |= pairs[e] << np.uint8(2 * r)
            out[whole * 64 + b] = byte


def _trailing_zeros_typing(typingctx: object, word: types.Type) -> tuple[Signature, _Codegen]:  # pragma: no cover - compiled
    """The number of trailing zero bits of a uint64 (64 for 0)."""

    def codegen(context: Any, builder: Any, signature: Signature, args: Sequence[Any]) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return types.uint64(word), codegen


_trailing_zeros = cast("Callable[[np.uint64], np.uint64]", intrinsic(_trailing_zeros_typing))


@njit(nogil=True, cache=True)
def _repeated(plain: np.ndarray, anchors: np.ndarray, slots: np.ndarray) -> int:  # pragma: no cover - compiled
    """Bytes of ``plain`` an LZ coder could take from earlier ones, estimated: 8-byte words equal to the next (runs
    and patterns of period 1, 2, 4 or 8), plus repeats of at least MIN_REPEAT bytes at any distance, found from
    positions chosen by their content (so at the same place in every copy). ``anchors`` (at least 8 bytes longer
    than ``plain``) and ``slots`` are work space."""
    size = len(plain)
    found = 0
    for i in range(0, size - 15, 8):
        if _load_u64(plain, i) == _load_u64(plain, i + 8):
            found += 8
    n = max(size - 7, 0)  # positions with 8 bytes from them
    b0, b1, b2, b3, flags = plain[:n], plain[1 : n + 1], plain[2 : n + 2], plain[3 : n + 3], anchors[:n]
    for i in range(n):  # vectorizes: the slices need no index checks
        head = np.uint32(b0[i]) | (np.uint32(b1[i]) << np.uint32(8)) | (np.uint32(b2[i]) << np.uint32(16))
        head |= np.uint32(b3[i]) << np.uint32(24)
        flags[i] = np.uint8(np.uint32(head * _ANCHOR_HASH) < _ANCHOR_BELOW)
    anchors[n : n + 8] = 0
    slots[:] = -1
    i = 0
    while i < n:
        word = _load_u64(anchors, i)
        if word == np.uint64(0):
            i += 8
            continue
        i += int(_trailing_zeros(word) >> np.uint64(3))  # the next anchor
        window = _load_u64(plain, i)
        slot = np.int64((window * _SLOT_HASH) >> np.uint64(64 - _SLOT_BITS))
        earlier, slots[slot] = slots[slot], i
        if earlier >= 0 and _load_u64(plain, earlier) == window:
            length = 8
            while i + length + 8 <= size and _load_u64(plain, earlier + length) == _load_u64(plain, i + length):
                length += 8
            if length >= MIN_REPEAT:
                found += length
                i += length
                continue
        i += 1
    return found


@njit(nogil=True, cache=True)
def survey(
    planes: np.ndarray, starts: np.ndarray, sizes: np.ndarray, anchors: np.ndarray,
    lengths: np.ndarray, stream_bytes: np.ndarray, huffman_bytes: np.ndarray, repeated: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """For each piece i, ``planes[starts[i] : starts[i] + sizes[i]]`` (the planes laid end to end): its Huffman code
    lengths (``lengths[i]``) and the exact sizes of its Huffman streams and frame (``stream_bytes[i]``,
    ``huffman_bytes[i]``) from its bytes counted per stream, and an estimate of its ``repeated`` bytes (``anchors``:
    work space 8 bytes longer than a piece)."""
    counts = np.empty((huffman.STREAMS, 256), np.int64)
    slots = np.empty(1 << _SLOT_BITS, np.int64)
    for f in range(len(starts)):
        plain = planes[starts[f] : starts[f] + sizes[f]]
        huffman.stream_counts(plain, counts)
        lengths[f] = huffman._code_lengths(counts.sum(axis=0))
        huffman_bytes[f] = huffman.frame_size(counts, lengths[f], stream_bytes[f])
        repeated[f] = _repeated(plain, anchors, slots)

