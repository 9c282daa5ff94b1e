"""Canonical Huffman coding of a byte plane in four streams, decoded several symbols per table lookup.

An exponent plane holds 2.5-4 bits of information per byte, and a reader decodes every plane of every
chunk it fetches, so the entropy decoder bounds how fast a pack arrives. zstd's Huffman literals decode
one or two symbols per lookup; this coder's codes are at most ``MAX_LENGTH`` (11) bits, so one lookup of
the next 11 bits yields every code that fits in them (up to four symbols, about 3.4 on a KV exponent
plane), and four streams are decoded in one loop, so the processor works on four lookups at once. The
decoder refuses any frame that would read or write out of bounds: a frame is parsed and checked, and
every stream must end exactly where its length says. The frame layout is docs/format.md §1.4.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from packstore.errors import IntegrityError

if TYPE_CHECKING:
    from numba.core.typing import Signature

SHIFT = 28

if sys.byteorder != "little":  # pragma: no cover - the unaligned loads below read little-endian words
    raise ImportError("packstore's Huffman decoder needs a little-endian machine")

MAX_LENGTH = 11  # longest code, and the bits one table lookup sees
STREAMS = 4
TABLE = 1 << MAX_LENGTH
STEPS = 56 // MAX_LENGTH  # lookups per refill: a refill leaves at least 57 unread bits in the window
LOOKUP_SYMBOLS = 4  # most symbols one lookup yields (one 32-bit store)
_FRAME_FIXED = 2 + 4 * (STREAMS - 1)  # first symbol, count - 1, then the first three streams' lengths
OK, TRUNCATED, BAD_CODE, BAD_STREAM = 0, 1, 2, 3
ERRORS = {
    TRUNCATED: "Huffman frame is truncated",
    BAD_CODE: "Huffman frame's code lengths do not form a complete prefix code of at most 11 bits",
    BAD_STREAM: "Huffman frame's streams do not decode to exactly their symbols and bytes",
}
_U = np.uint64
# Compiled kernels take integers as Python ints or numpy integers alike (numba specialises on what arrives).
Int = int | np.integer
# numba's target context and llvmlite's IR builder and values are untyped.
_Codegen = Callable[[Any, Any, "Signature", Sequence[Any]], Any]


def _load_u64_typing(typingctx: object, array: types.Type, index: types.Type) -> tuple[Signature, _Codegen]:  # pragma: no cover
    """The 8 bytes of a uint8 array at ``index`` as one little-endian word (unaligned; no bounds check)."""

    def codegen(context: Any, builder: Any, signature: Signature, args: Sequence[Any]) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(pointer, align=1)

    return types.uint64(array, index), codegen


def _store_u32_typing(
    typingctx: object, array: types.Type, index: types.Type, value: types.Type
) -> tuple[Signature, _Codegen]:  # pragma: no cover - compiled
    """Store the low 4 bytes of ``value`` into a uint8 array at ``index`` (unaligned; no bounds check)."""

    def codegen(context: Any, builder: Any, signature: Signature, args: Sequence[Any]) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(32).as_pointer())
        builder.store(builder.trunc(args[2], ir.IntType(32)), pointer, align=1)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


# numba's stubs type an intrinsic as its typing function (typing context first) returning Never, which is
# how a call from Python behaves; compiled code calls it with the arguments below.
_load_u64 = cast("Callable[[np.ndarray, Int], np.uint64]", intrinsic(_load_u64_typing))
_store_u32 = cast("Callable[[np.ndarray, Int, Int], None]", intrinsic(_store_u32_typing))


# -- writing -------------------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _code_lengths(counts: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled; tested through encode
    """Huffman code lengths (at most MAX_LENGTH) for the byte counts ``counts``: a complete prefix code over
    the bytes that occur (two codes of length 1 when only one does). Ties go to the smaller byte, so the
    lengths depend on the counts alone."""
    lengths = np.zeros(256, np.uint8)
    present = np.nonzero(counts)[0]
    m = len(present)
    if m == 1:
        only = present[0]
        lengths[only] = 1
        lengths[only + 1 if only < 255 else only - 1] = 1
        return lengths
    ascending = present[np.argsort(counts[present], kind="mergesort")]
    weight = np.zeros(2 * m - 1, np.int64)
    parent = np.zeros(2 * m - 1, np.int64)
    weight[:m] = counts[ascending]
    leaf, inner = 0, m  # two queues: leaves by weight, and inner nodes in the (rising) order they are made
    for node in range(m, 2 * m - 1):
        for _ in range(2):
            if leaf < m and (inner >= node or weight[leaf] <= weight[inner]):
                child = leaf
                leaf += 1
            else:
                child = inner
                inner += 1
            parent[child] = node
            weight[node] += weight[child]
    depth = np.zeros(2 * m - 1, np.int64)
    for node in range(2 * m - 3, -1, -1):
        depth[node] = depth[parent[node]] + 1
    per_length = np.zeros(max(depth[:m].max(), MAX_LENGTH) + 1, np.int64)
    for node in range(m):
        per_length[depth[node]] += 1
    for longest in range(len(per_length) - 1, MAX_LENGTH, -1):  # JPEG's adjustment (ITU T.81 K.3): Kraft sum kept at 1
        while per_length[longest] > 0:
            shorter = longest - 2
            while per_length[shorter] == 0:
                shorter -= 1
            per_length[longest] -= 2
            per_length[longest - 1] += 1
            per_length[shorter + 1] += 2
            per_length[shorter] -= 1
    by_count = present[np.argsort(-counts[present], kind="mergesort")]  # most frequent first, ties to the smaller byte
    k = 0
    for length in range(1, MAX_LENGTH + 1):
        for _ in range(per_length[length]):
            lengths[by_count[k]] = length
            k += 1
    return lengths


@njit(nogil=True, cache=True)
def _reversed_codes(lengths: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Each byte's canonical code (by length, then byte value), bit-reversed: the stream is read from bit 0 up."""
    codes = np.zeros(256, np.uint64)
    code = 0
    for length in range(1, MAX_LENGTH + 1):
        for symbol in range(256):
            if lengths[symbol] == length:
                reverse, rest = 0, code
                for _ in range(length):
                    reverse = (reverse << 1) | (rest & 1)
                    rest >>= 1
                codes[symbol] = reverse
                code += 1
        code <<= 1
    return codes


@njit(nogil=True, cache=True)
def stream_counts(plain: np.ndarray, counts: np.ndarray) -> None:  # pragma: no cover - compiled
    """``counts[k]`` := the byte counts of stream k's quarter of ``plain`` (four counts at once: independent increments)."""
    quarter = (len(plain) + STREAMS - 1) // STREAMS
    counts[:] = 0
    c0, c1, c2, c3 = counts[0], counts[1], counts[2], counts[3]
    s0, s1, s2, s3 = plain[:quarter], plain[quarter : 2 * quarter], plain[2 * quarter : 3 * quarter], plain[3 * quarter :]
    for i in range(len(s3)):
        c0[s0[i]] += 1
        c1[s1[i]] += 1
        c2[s2[i]] += 1
        c3[s3[i]] += 1
    for i in range(len(s3), quarter):  # the first three streams' last few bytes
        c0[s0[i]] += 1
        if i < len(s1):
            c1[s1[i]] += 1
        if i < len(s2):
            c2[s2[i]] += 1


@njit(nogil=True, cache=True)
def frame_size(counts: np.ndarray, lengths: np.ndarray, stream_bytes: np.ndarray) -> int:  # pragma: no cover - compiled
    """The size of the frame of bytes with stream ``counts`` (``stream_counts``) coded with ``lengths``; each
    stream's bytes go to ``stream_bytes``."""
    first, last = 0, 255
    while lengths[first] == 0:
        first += 1
    while lengths[last] == 0:
        last -= 1
    total = _FRAME_FIXED + (last - first + 2) // 2
    for k in range(STREAMS):
        bits = 0
        for symbol in range(first, last + 1):
            bits += counts[k, symbol] * lengths[symbol]
        stream_bytes[k] = (bits + 7) // 8
        total += stream_bytes[k]
    return total


@njit(nogil=True, cache=True)
def _encode_stream(plain: np.ndarray, codes: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Write ``plain``'s codes to ``out`` from bit 0 of byte 0 up (the last byte padded with 0s)."""
    acc, bits, at = _U(0), 0, 0
    for i in range(len(plain)):
        symbol = plain[i]
        acc |= codes[symbol] << _U(bits)
        bits += lengths[symbol]
        if bits >= 32:
            _store_u32(out, at, acc)
            at += 4
            acc >>= _U(32)
            bits -= 32
    while bits > 0:
        out[at] = np.uint8(acc & _U(0xFF))
        at += 1
        acc >>= _U(8)
        bits -= 8


@njit(nogil=True, cache=True)
def write_frame(plain: np.ndarray, lengths: np.ndarray, stream_bytes: np.ndarray, out: np.ndarray) -> int:  # pragma: no cover
    """Write the frame of ``plain`` (at least one byte) coded with ``lengths`` (``_code_lengths`` of its counts), its
    streams ``stream_bytes`` long (``frame_size``), to ``out``, which has room for it; returns its size."""
    first, last = 0, 255
    while lengths[first] == 0:
        first += 1
    while lengths[last] == 0:
        last -= 1
    out[0], out[1] = first, last - first
    at = 2
    for i in range(first, last + 1, 2):
        out[at] = lengths[i] | ((lengths[i + 1] << np.uint8(4)) if i + 1 <= last else np.uint8(0))
        at += 1
    for k in range(STREAMS - 1):
        for b in range(4):
            out[at + 4 * k + b] = (stream_bytes[k] >> (8 * b)) & 0xFF
    at += 4 * (STREAMS - 1)
    codes, widths = _reversed_codes(lengths), lengths.astype(np.int64)
    quarter = (len(plain) + STREAMS - 1) // STREAMS
    for k in range(STREAMS):
        _encode_stream(plain[k * quarter : (k + 1) * quarter], codes, widths, out[at : at + stream_bytes[k]])
        at += stream_bytes[k]
    return at


def encode(plain: np.ndarray) -> bytes:
    """One Huffman frame of ``plain`` (uint8, at least one byte): the code lengths, then four streams, each
    holding the codes of a quarter of the bytes (docs/format.md §1.4)."""
    if plain.size == 0:
        raise ValueError("a Huffman frame codes at least one byte")
    counts, stream_bytes = np.empty((STREAMS, 256), np.int64), np.empty(STREAMS, np.int64)
    stream_counts(plain, counts)
    lengths = _code_lengths(counts.sum(axis=0))
    out = np.empty(frame_size(counts, lengths, stream_bytes), np.uint8)
    write_frame(plain, lengths, stream_bytes, out)
    return out.tobytes()


# -- reading -------------------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _build_tables(
    lengths: np.ndarray, single_symbol: np.ndarray, single_length: np.ndarray, lookups: np.ndarray
) -> bool:  # pragma: no cover - compiled
    """Lookup tables over every MAX_LENGTH-bit window: the first code's symbol and length (``single_*``), and every
    whole code in the window (``lookups[2w]``: up to 4 bytes; ``lookups[2w+1]``: bits used | symbol count << 32). False unless
    ``lengths`` form a complete prefix code (every window then starts with a code)."""
    kraft = 0
    for symbol in range(256):
        if lengths[symbol] > MAX_LENGTH:
            return False
        if lengths[symbol]:
            kraft += 1 << (MAX_LENGTH - lengths[symbol])
    if kraft != TABLE:
        return False
    codes = _reversed_codes(lengths)
    for symbol in range(256):
        if lengths[symbol]:
            for window in range(np.int64(codes[symbol]), TABLE, 1 << np.int64(lengths[symbol])):  # every window it begins
                single_symbol[window] = symbol
                single_length[window] = lengths[symbol]
    for window in range(TABLE):
        used, packed, count = 0, np.int64(0), 0
        while count < LOOKUP_SYMBOLS:
            rest = window >> used
            length = single_length[rest]
            if used + length > MAX_LENGTH:
                break
            packed |= np.int64(single_symbol[rest]) << (8 * count)
            used += length
            count += 1
        lookups[window] = _U(packed) | ((_U(used) | (_U(count) << _U(SHIFT))) << _U(32))
    return True


@njit(nogil=True, cache=True, inline="always")
def _window(src: np.ndarray, state: np.uint64) -> np.uint64:
    position = state & _U((1 << SHIFT) - 1)
    return _load_u64(src, position >> _U(3)) >> (position & _U(7))


@njit(nogil=True, cache=True, inline="always")
def _lookup(lookups: np.ndarray, out: np.ndarray, window: np.uint64, state: np.uint64) -> tuple[np.uint64, np.uint64]:
    entry = lookups[window & _U(TABLE - 1)]
    _store_u32(out, state >> _U(SHIFT), entry)
    step = entry >> _U(32)
    return window >> (step & _U(63)), state + step


@njit(nogil=True, cache=True)
def _four_streams(
    src: np.ndarray, out: np.ndarray, lookups: np.ndarray, s0: np.uint64, s1: np.uint64, s2: np.uint64, s3: np.uint64,
    e0: np.uint64, e1: np.uint64, e2: np.uint64, e3: np.uint64, o0: np.uint64, o1: np.uint64, o2: np.uint64, o3: np.uint64,
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    low = _U((1 << SHIFT) - 1)
    while True:
        # iterations that cannot run out of input (<= 7 bytes each) or output (<= 20 symbols each)
        k = min(
            min((np.int64(e0) - np.int64((s0 & low) >> _U(3)) - 8) // 7, (np.int64(o0) - np.int64(s0 >> _U(SHIFT)) - 20) // 20),
            min((np.int64(e1) - np.int64((s1 & low) >> _U(3)) - 8) // 7, (np.int64(o1) - np.int64(s1 >> _U(SHIFT)) - 20) // 20),
            min((np.int64(e2) - np.int64((s2 & low) >> _U(3)) - 8) // 7, (np.int64(o2) - np.int64(s2 >> _U(SHIFT)) - 20) // 20),
            min((np.int64(e3) - np.int64((s3 & low) >> _U(3)) - 8) // 7, (np.int64(o3) - np.int64(s3 >> _U(SHIFT)) - 20) // 20),
        ) + 1
        if k <= 0:
            return s0, s1, s2, s3
        for _ in range(k):
            w0, w1, w2, w3 = _window(src, s0), _window(src, s1), _window(src, s2), _window(src, s3)
            for _ in range(STEPS):
                w0, s0 = _lookup(lookups, out, w0, s0)
                w1, s1 = _lookup(lookups, out, w1, s1)
                w2, s2 = _lookup(lookups, out, w2, s2)
                w3, s3 = _lookup(lookups, out, w3, s3)


@njit(nogil=True, cache=True)
def _tail(
    src: np.ndarray, position: Int, end: Int, single_symbol: np.ndarray, single_length: np.ndarray, out: np.ndarray, at: Int, stop: Int
) -> bool:  # pragma: no cover - compiled
    """Decode one code at a time, reading only bytes before ``end``, until ``out[stop]``; True if the stream ends
    exactly at its last byte."""
    while at < stop:
        byte, window = position >> 3, np.int64(0)
        for k in range(3):  # MAX_LENGTH + 7 <= 24 bits
            if byte + k < end:
                window |= np.int64(src[byte + k]) << (8 * k)
        window = (window >> (position & 7)) & (TABLE - 1)
        length = np.int64(single_length[window])
        if position + length > end * 8:
            return False
        out[at] = single_symbol[window]
        at += 1
        position += length
    return (position + 7) >> 3 == end


@njit(nogil=True, cache=True)
def decode_frame(
    src: np.ndarray, start: Int, stop: Int, out: np.ndarray, at: Int, count: Int, single_symbol: np.ndarray, single_length: np.ndarray,
    lookups: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """Decode the frame ``src[start:stop]`` into ``out[at : at + count]`` (the caller guarantees both lie in their
    arrays), with ``single_symbol``, ``single_length`` and ``lookups`` (``TABLE`` entries each, uint8, uint8, uint64)
    as work space for the tables it builds, reused from frame to frame; OK or the error's code (ERRORS). Compiled code calls it directly."""
    if stop - start < _FRAME_FIXED or stop - start >= (1 << (SHIFT - 3)):
        return TRUNCATED
    first, used = np.int64(src[start]), np.int64(src[start + 1]) + 1
    table_bytes = (used + 1) // 2
    if first + used > 256 or stop - start < _FRAME_FIXED + table_bytes:
        return TRUNCATED if first + used <= 256 else BAD_CODE
    lengths = np.zeros(256, np.uint8)
    for i in range(used):
        packed = src[start + 2 + i // 2]
        lengths[first + i] = (packed >> 4) if i % 2 else (packed & 15)
    if not _build_tables(lengths, single_symbol, single_length, lookups):
        return BAD_CODE
    sizes = start + 2 + table_bytes
    starts, ends = np.empty(STREAMS, np.int64), np.empty(STREAMS, np.int64)
    starts[0] = sizes + 4 * (STREAMS - 1)
    for k in range(STREAMS - 1):
        size = np.int64(0)
        for b in range(4):
            size |= np.int64(src[sizes + 4 * k + b]) << (8 * b)
        ends[k] = starts[k + 1] = starts[k] + size
    ends[STREAMS - 1] = stop
    if starts[STREAMS - 1] > stop:
        return TRUNCATED
    quarter = (count + STREAMS - 1) // STREAMS
    frame, dest = src[start:stop], out[at : at + count]
    o0, o1, o2, o3 = min(quarter, count), min(2 * quarter, count), min(3 * quarter, count), count
    b0, b1, b2, b3 = starts[0] - start, starts[1] - start, starts[2] - start, starts[3] - start
    s0, s1, s2, s3 = _four_streams(
        frame, dest, lookups,
        _U(b0 * 8), _U(b1 * 8) | (_U(o0) << _U(SHIFT)), _U(b2 * 8) | (_U(o1) << _U(SHIFT)), _U(b3 * 8) | (_U(o2) << _U(SHIFT)),
        _U(ends[0] - start), _U(ends[1] - start), _U(ends[2] - start), _U(ends[3] - start), _U(o0), _U(o1), _U(o2), _U(o3),
    )
    low = _U((1 << SHIFT) - 1)
    ok = _tail(frame, np.int64(s0 & low), ends[0] - start, single_symbol, single_length, dest, np.int64(s0 >> _U(SHIFT)), o0)
    ok &= _tail(frame, np.int64(s1 & low), ends[1] - start, single_symbol, single_length, dest, np.int64(s1 >> _U(SHIFT)), o1)
    ok &= _tail(frame, np.int64(s2 & low), ends[2] - start, single_symbol, single_length, dest, np.int64(s2 >> _U(SHIFT)), o2)
    ok &= _tail(frame, np.int64(s3 & low), ends[3] - start, single_symbol, single_length, dest, np.int64(s3 >> _U(SHIFT)), o3)
    return OK if ok else BAD_STREAM


@njit(nogil=True, cache=True)
def check_frame(src: np.ndarray, start: Int, stop: Int) -> int:  # pragma: no cover - compiled; tested against decode_frame
    """``decode_frame``'s checks of the frame ``src[start:stop]`` short of decoding its streams: its size, that its code
    lengths form a complete prefix code of at most MAX_LENGTH bits, and that its first three streams end within it; OK
    or the error's code (ERRORS), the one ``decode_frame`` returns for such a frame. A decoder elsewhere (the GPU's,
    ``packstore.format.huffman_cuda``) checks the streams themselves."""
    if stop - start < _FRAME_FIXED or stop - start >= (1 << (SHIFT - 3)):
        return TRUNCATED
    first, used = np.int64(src[start]), np.int64(src[start + 1]) + 1
    table_bytes = (used + 1) // 2
    if first + used > 256 or stop - start < _FRAME_FIXED + table_bytes:
        return TRUNCATED if first + used <= 256 else BAD_CODE
    kraft = np.int64(0)
    for i in range(used):
        packed = src[start + 2 + i // 2]
        length = np.int64((packed >> 4) if i % 2 else (packed & 15))
        if length > MAX_LENGTH:
            return BAD_CODE
        if length:
            kraft += 1 << (MAX_LENGTH - length)
    if kraft != TABLE:
        return BAD_CODE
    sizes = start + 2 + table_bytes
    end = sizes + 4 * (STREAMS - 1)
    for k in range(STREAMS - 1):
        for b in range(4):
            end += np.int64(src[sizes + 4 * k + b]) << (8 * b)
    return TRUNCATED if end > stop else OK


@njit(nogil=True, cache=True)
def _decode_frames(
    src: np.ndarray, starts: np.ndarray, stops: np.ndarray, out: np.ndarray, ats: np.ndarray, counts: np.ndarray
) -> int:  # pragma: no cover - compiled
    """Decode frame ``i`` (``src[starts[i]:stops[i]]``) into ``out[ats[i] : ats[i] + counts[i]]`` for every i; -1, or
    the first failing frame's index * 16 + its error code."""
    single_symbol, single_length, lookups = np.empty(TABLE, np.uint8), np.empty(TABLE, np.uint8), np.empty(TABLE, np.uint64)
    for i in range(len(starts)):
        found = decode_frame(src, starts[i], stops[i], out, ats[i], counts[i], single_symbol, single_length, lookups)
        if found != OK:
            return i * 16 + found
    return -1


def decode_frames(src: np.ndarray, starts: np.ndarray, stops: np.ndarray, out: np.ndarray, ats: np.ndarray, counts: np.ndarray) -> None:
    """Decode the Huffman frames ``src[starts[i]:stops[i]]`` into ``out[ats[i] : ats[i] + counts[i]]`` (one compiled
    call, the GIL released); IntegrityError naming the first frame that is malformed. The caller guarantees that
    every frame lies in ``src`` and every output range in ``out``."""
    failed = _decode_frames(src, starts, stops, out, ats, counts)
    if failed >= 0:
        raise IntegrityError(f"{ERRORS[failed % 16]} (frame {failed // 16})")
