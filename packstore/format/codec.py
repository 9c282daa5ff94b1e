"""Byte-plane codec: lossless compression of tensor bytes that plain zstd handles poorly.

Float elements compress badly as a byte stream because their low mantissa bytes are noise
interleaved with well-behaved exponent bytes. This codec splits a safetensors blob into its
header and, per byte position of the element, one *plane* (plane j holds byte j of every
element, little-endian). Container version 3 (codec ``byteplane-3``, written now) first rotates
float32 and bfloat16 elements left by one bit, so that the last plane holds exactly the 8-bit
exponent and the sign joins the noisy mantissa, and splits a float16 into its low byte, its sign and
exponent (6 bits a byte) and its two top mantissa bits (packed four to a byte), so that only
informative bits are entropy-coded; it codes each plane in segments that end where the chunk's
tensors do, each the smaller of a Huffman frame (``packstore.format.huffman``: four streams,
several symbols a lookup), a level-1 zstd frame (whose matches win on runs) and the raw bytes.
Writing runs in compiled kernels with the GIL released (``packstore.format.split``), so chunks encode in
parallel threads. Container versions 2 (``byteplane-zstd-2``: zstd frames only, float16 unsplit) and 1
(``byteplane-zstd``: whole planes at zstd level 1) still decode. See docs/format.md §1.4.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard
from numba import njit

from packstore.errors import IntegrityError
from packstore.format import huffman
from packstore.format.body import tensor_table
from packstore.format.header import DTYPE_SIZES
from packstore.format.interleave import join_planes, pack_pairs, packed_length, unpack_pairs
from packstore.format.split import split_float16, split_rotated2, split_rotated4, survey

MAGIC = b"PSBP"
VERSION = 3  # the container writers write
RAW, ZSTD, HUFFMAN = 0, 1, 2
METHODS = {2: (RAW, ZSTD), 3: (RAW, ZSTD, HUFFMAN)}  # frame methods by container version
RAW_THRESHOLD = 0.98  # a frame that saves less than 2 % is stored raw
ZSTD_PREFERENCE = 0.75  # a segment is coded with zstd rather than Huffman only when that saves 25 % (zstd decodes slower)
# zstd is tried on a segment when the survey finds 1/128 of it repeated: on real KV (smollm2-135m, all three dtypes)
# it won only where 5 % or more was (the first layers' repeated rows), and where none is its frame is about the Huffman one.
REPEATS_WORTH_ZSTD = 128
SEGMENT = 1 << 16  # fewest plain bytes per coded piece of a plane (v2) that writers use
WRITE_SEGMENT_LIMIT = 1 << 20  # most plain bytes per piece that writers use
MAX_SEGMENT = 1 << 24  # most that readers accept
ROTATED = frozenset({"float32", "bfloat16"})  # their 8-bit exponent straddles two bytes until rotated
NO_TRANSFORM, ROTATE_LEFT_1, SPLIT_FLOAT16 = 0, 1, 2
TRANSFORMS = {2: (NO_TRANSFORM, ROTATE_LEFT_1), 3: (NO_TRANSFORM, ROTATE_LEFT_1, SPLIT_FLOAT16)}  # by container version
_V1 = struct.Struct("<4sBBB")  # magic, version 1, element size, frame count
_V1_FRAME = struct.Struct("<BQQ")  # method, plain length, stored length
_PREAMBLE = struct.Struct("<4sBBBIQI")  # versions 2 and 3: magic, version, element size, transform, header length, elements, segment
_ENTRY = struct.Struct("<BI")  # versions 2 and 3: a frame's method and stored length
_UNSIGNED: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_ALIGN = 64
MAX_SCRATCH = 1 << 26  # bytes of a joined plane range kept for reuse per thread (real tensors' are a few MB at most)
# Per thread: a compressor and a decompressor; the planes a chunk is split into, and the container it is written to;
# the buffer Huffman frames decode into, and buffers for plane ranges that span segments.
_SCRATCH = threading.local()


def safetensors_split(blob: bytes | memoryview) -> int:
    """Length of a safetensors blob's header (8-byte size + JSON); the tensor data follows it."""
    if len(blob) < 8:
        raise IntegrityError("safetensors blob is shorter than its size field")
    size: int = struct.unpack_from("<Q", blob)[0]
    return 8 + size


def segment_for(tensor_elements: list[int]) -> int:
    """Plain bytes per plane segment for tensors of these element counts: the smallest multiple of their common
    size (gcd) that is at least SEGMENT, at most WRITE_SEGMENT_LIMIT. Segments then end at tensor boundaries, so
    each of a chunk's K and V tensors gets its own Huffman tables, and a chunk has few segments to decode."""
    common = math.gcd(*tensor_elements) or SEGMENT
    return min(WRITE_SEGMENT_LIMIT, common * -(-SEGMENT // common))


def transform_for(dtype: str) -> int:
    """The transform writers use for ``dtype``: rotation for float32 and bfloat16, the split for float16."""
    return ROTATE_LEFT_1 if dtype in ROTATED else SPLIT_FLOAT16


def encode(blob: bytes, dtype: str, segment: int | None = None) -> bytes:
    """Compress a safetensors blob whose tensors are all of ``dtype`` (container version 3), in segments of
    ``segment`` elements (None: ``segment_for`` the blob's tensors, read strictly).

    Each segment is the smallest of its Huffman frame, its level-1 zstd frame when that is ZSTD_PREFERENCE of the
    Huffman size or less, and its raw bytes (when neither saves 2 %). The split and the Huffman sizes are computed
    in compiled kernels with the GIL released (``packstore.format.split``); zstd, the only costly step left, runs only
    on segments where the survey finds repeats (runs, repeated rows): on the rest its matches cannot pay for
    themselves, and it would only make a frame the size of the Huffman one, so it is never chosen there."""
    width = DTYPE_SIZES[dtype]
    split = safetensors_split(blob)
    if (len(blob) - split) % width:
        raise ValueError(f"tensor data of {len(blob) - split} bytes is not a whole number of {width}-byte elements")
    elements = np.frombuffer(blob, dtype=_UNSIGNED[width], offset=split)
    if segment is None:
        segment = segment_for([(t.stop - t.start) // width for t in tensor_table(blob)])
    if not 0 < segment <= MAX_SEGMENT:
        raise ValueError(f"segment {segment} is outside 1 .. {MAX_SEGMENT}")
    transform = transform_for(dtype)
    planes, starts, sizes = _split(elements, transform, segment)
    lengths, stream_bytes = np.empty((len(starts), 256), np.uint8), np.empty((len(starts), huffman.STREAMS), np.int64)
    huffman_bytes, repeated = np.empty(len(starts), np.int64), np.empty(len(starts), np.int64)
    survey(planes, starts, sizes, _scratch("anchors", segment + 8), lengths, stream_bytes, huffman_bytes, repeated)
    header: Frame = (RAW, split, np.frombuffer(blob, np.uint8, split))  # a few hundred bytes of JSON: stored raw
    pieces = enumerate(zip(starts.tolist(), sizes.tolist()))
    frames = [header] + [_choose(planes[start : start + size], int(huffman_bytes[i]), int(repeated[i])) for i, (start, size) in pieces]
    table = b"".join(_ENTRY.pack(method, length) for method, length, _ in frames)
    out = _scratch("encoded", _PREAMBLE.size + len(table) + sum(length for _, length, _ in frames))
    out[: _PREAMBLE.size] = np.frombuffer(_PREAMBLE.pack(MAGIC, VERSION, width, transform, split, len(elements), segment), np.uint8)
    at = _PREAMBLE.size + len(table)
    out[_PREAMBLE.size : at] = np.frombuffer(table, np.uint8)
    for i, (_, length, body) in enumerate(frames):
        if body is None:  # a Huffman frame, written in place
            piece = planes[starts[i - 1] : starts[i - 1] + sizes[i - 1]]
            huffman.write_frame(piece, lengths[i - 1], stream_bytes[i - 1], out[at : at + length])
        else:
            out[at : at + length] = np.frombuffer(body, np.uint8)
        at += length
    return out.tobytes()


# A frame being written: its method, its stored length, and its bytes (None: a Huffman frame, written in place).
Frame = tuple[int, int, "np.ndarray | bytes | None"]


def _choose(plain: np.ndarray, huffman_bytes: int, repeated: int) -> Frame:
    """A plane segment's frame: Huffman, or level-1 zstd where that is ZSTD_PREFERENCE of the Huffman size or less
    (zstd decodes slower), or raw when neither saves 2 %. zstd is run only where ``repeated`` says it may win."""
    frame: Frame = (HUFFMAN, huffman_bytes, None)
    if repeated * REPEATS_WORTH_ZSTD >= len(plain):
        matched = _compressor().compress(plain.data)
        if len(matched) <= ZSTD_PREFERENCE * huffman_bytes:
            frame = (ZSTD, len(matched), matched)
    if frame[1] >= RAW_THRESHOLD * len(plain):
        return RAW, len(plain), plain
    return frame


def _split(elements: np.ndarray, transform: int, segment: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The planes of ``elements`` under ``transform``, laid end to end in a buffer of this thread, and the start and
    size there of each piece to code: plane by plane, segment by segment (the float16 split's packed plane in
    ``packed_length`` bytes per segment)."""
    count, n = len(elements), max(len(elements), 1)
    rows = 3 if transform == SPLIT_FLOAT16 else elements.itemsize
    planes = _scratch("planes", rows * n)
    if transform == SPLIT_FLOAT16:
        split_float16(elements, segment, *planes.reshape(rows, n))
    elif rows == 2:
        split_rotated2(elements, *planes.reshape(rows, n))
    else:
        split_rotated4(elements, *planes.reshape(rows, n))
    firsts = range(0, count, segment)
    starts = [row * n + first for row in range(rows) for first in firsts]
    sizes = [min(segment, count - first) for _ in range(rows) for first in firsts]
    if transform == SPLIT_FLOAT16:
        starts[2 * len(firsts) :] = [2 * n + k * packed_length(segment) for k in range(len(firsts))]
        sizes[2 * len(firsts) :] = [packed_length(size) for size in sizes[: len(firsts)]]
    return planes, np.array(starts, np.int64), np.array(sizes, np.int64)


@dataclass(frozen=True)
class Planes:
    """A container's frames once decoded: the safetensors header, and the planes (byte j of every element; for the
    float16 split the low byte, bits 10-15, and bits 8-9 packed per segment), each held as the segments it was
    coded in: element ``i`` of plane ``j`` is ``segments[j][i // segment][i % segment]``. A segment is a view of
    the container when stored raw, else its decoded bytes (Huffman frames decode into a buffer of the decoding
    thread: a Planes is good until that thread decodes the next container). ``write`` puts elements back together
    wherever they belong, straight from the segments when a tensor lies within one (writers end segments at
    tensor boundaries), so planes are never first copied whole."""

    header: bytes | memoryview
    segments: list[list[np.ndarray]]
    segment: int
    elements: int
    element_size: int
    transform: int

    @property
    def rotated(self) -> bool:
        """Elements were rotated left by one bit before the split."""
        return self.transform == ROTATE_LEFT_1

    def plane(self, index: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``start`` to ``stop`` (the end when None) of byte plane ``index``: a view of one segment when they
        lie within it, else joined into a buffer of this thread that the next join of that plane reuses."""
        stop = self.elements if stop is None else stop
        parts = self.segments[index]
        if start == stop:
            return np.empty(0, dtype=np.uint8)
        first, last = start // self.segment, (stop - 1) // self.segment
        if first == last:
            base = first * self.segment
            return parts[first][start - base : stop - base]
        joined = _scratch_plane(index, stop - start)
        at = 0
        for k in range(first, last + 1):
            piece = parts[k][max(start - k * self.segment, 0) : stop - k * self.segment]
            joined[at : at + len(piece)] = piece
            at += len(piece)
        return joined

    def packed(self, start: int, stop: int) -> tuple[np.ndarray, int, int]:
        """The float16 split's packed plane for elements ``start`` to ``stop``: (packed bytes, the element there of
        ``start``, the elements they cover). One segment's own bytes when the range lies within it; else the
        range's bits packed again on their own (tensors larger than a segment only)."""
        if start == stop:
            return np.empty(0, dtype=np.uint8), 0, 0
        first, last = start // self.segment, (stop - 1) // self.segment
        if first == last:
            return self.segments[2][first], start - first * self.segment, min(self.segment, self.elements - first * self.segment)
        values = [
            unpack_pairs(self.segments[2][k], min(self.segment, self.elements - k * self.segment))[
                max(start - k * self.segment, 0) : stop - k * self.segment
            ]
            for k in range(first, last + 1)
        ]
        return pack_pairs(np.concatenate(values)), 0, stop - start

    def write(self, out: np.ndarray, first: int, shape: tuple[int, int, int], offset: int = 0, count: int | None = None) -> None:
        """Join elements ``first`` onwards, seen as an array of ``shape`` ``[A, T, D]``, into ``out``: a C-contiguous
        ``[A, P, D]`` array of uint16/uint32 (the bytes of a whole tensor). Positions ``0 .. count-1`` (all ``T``
        when None) go to ``out[:, offset : offset + count]``, so a token block lands in its place in the layer."""
        stop = first + shape[0] * shape[1] * shape[2]
        planes, packed = self.parts(first, stop)
        join_planes(planes, shape, out, offset, shape[1] if count is None else count, self.rotated, packed)

    def parts(self, start: int, stop: int) -> tuple[list[np.ndarray], tuple[np.ndarray, int, int] | None]:
        """What elements ``start`` to ``stop`` are joined from: their byte planes (``plane``), and for the float16
        split, its low byte and bits 10-15 with the packed plane (``packed``; None otherwise)."""
        if self.transform == SPLIT_FLOAT16:
            return [self.plane(0, start, stop), self.plane(1, start, stop)], self.packed(start, stop)
        return [self.plane(j, start, stop) for j in range(self.element_size)], None


def _need(stored: memoryview, size: int) -> None:
    """IntegrityError unless the container holds at least ``size`` bytes."""
    if len(stored) < size:
        raise IntegrityError("byte-plane container is truncated")


def _decompress(body: memoryview, plain_len: int, decompressor: zstandard.ZstdDecompressor) -> bytes:
    try:
        part = decompressor.decompress(body, max_output_size=plain_len)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"byte-plane frame cannot be decompressed: {exc}") from None
    if len(part) != plain_len:
        raise IntegrityError("byte-plane frame has the wrong decoded length")
    return part


def _frame(method: int, body: memoryview, plain_len: int, decompressor: zstandard.ZstdDecompressor) -> bytes | memoryview:
    """One frame's plain bytes (``body`` itself when raw)."""
    if method == RAW:
        if len(body) != plain_len:
            raise IntegrityError("byte-plane raw frame has the wrong length")
        return body
    if method == ZSTD:
        return _decompress(body, plain_len, decompressor)
    raise IntegrityError(f"unknown byte-plane frame method {method}")


def _check_declared(declared: int, max_plain_bytes: int) -> None:
    if declared > max_plain_bytes:
        raise IntegrityError(f"byte-plane container declares {declared} plain bytes, more than the {max_plain_bytes} allowed")


def _planes_v1(stored: memoryview, max_plain_bytes: int) -> Planes:
    _need(stored, _V1.size)
    _, _, width, count = _V1.unpack_from(stored)
    if count != width + 1 or width not in _UNSIGNED:
        raise IntegrityError(f"byte-plane container version 1 with {count} frames of {width}-byte elements")
    offset = _V1.size + count * _V1_FRAME.size
    _need(stored, offset)
    frames = list(_V1_FRAME.iter_unpack(stored[_V1.size : offset]))
    if offset + sum(f[2] for f in frames) != len(stored):
        raise IntegrityError("byte-plane container length does not match its frame table")
    _check_declared(sum(f[1] for f in frames), max_plain_bytes)
    decompressor = _decompressor()
    parts = []
    for method, plain_len, stored_len in frames:
        parts.append(_frame(method, stored[offset : offset + stored_len], plain_len, decompressor))
        offset += stored_len
    header, planes = parts[0], parts[1:]
    if len({len(p) for p in planes}) != 1:
        raise IntegrityError("byte-plane planes differ in length")
    elements = len(planes[0])
    return Planes(header, [[np.frombuffer(plane, dtype=np.uint8)] for plane in planes], max(elements, 1), elements, width, NO_TRANSFORM)


@dataclass(frozen=True)
class FrameTable:
    """A container (version 2 or 3) read up to its frames: the preamble's fields, the safetensors header ``H`` (frame 0,
    decoded), and per frame a row of ``table``: its method, its stored range in the container, its plain length, and
    where a Huffman frame's plain bytes go when the Huffman frames are decoded end to end (0 for other methods). Every
    check ``decode_planes`` makes is made, but a Huffman frame's streams are not decoded: its size, code lengths and
    stream table are checked (``huffman.check_frame``), what its streams hold is left to the decoder that decodes them
    (``packstore.format.huffman_cuda`` on a GPU). See ``frame_table``."""

    version: int
    element_size: int
    transform: int
    header: bytes | memoryview
    elements: int
    segment: int
    per_plane: int
    plane_count: int
    table: np.ndarray  # [1 + plane_count * per_plane, 5] int64: method, start, stop, plain length, place

    def plane_bytes(self, plane: int, segment: int | None = None) -> int:
        """Plain bytes of ``segment`` of ``plane`` (the whole plane when None): its elements, or their packed bytes in
        plane 2 of the float16 split."""
        if segment is None:
            return sum(self.plane_bytes(plane, k) for k in range(self.per_plane))
        size = min(self.segment, self.elements - segment * self.segment)
        return packed_length(size) if self.transform == SPLIT_FLOAT16 and plane == 2 else size


def _segmented_table(stored: memoryview, max_plain_bytes: int, version: int, decode: bool) -> tuple[FrameTable, np.ndarray]:
    """Container versions 2 and 3: the preamble and frame table, checked, every frame's plain length implied by the
    preamble; with ``decode``, every Huffman frame decoded end to end into the returned buffer (a thread's scratch)."""
    _need(stored, _PREAMBLE.size)
    _, _, width, transform, header_len, elements, segment = _PREAMBLE.unpack_from(stored)
    valid = width in _UNSIGNED and transform in TRANSFORMS[version] and (transform != SPLIT_FLOAT16 or width == 2)
    if not valid or not 0 < segment <= MAX_SEGMENT:
        raise IntegrityError(f"byte-plane container version {version} with {width}-byte elements, transform {transform}, segment {segment}")
    _check_declared(header_len + elements * width, max_plain_bytes)
    per_plane = math.ceil(elements / segment)
    plane_count = 3 if transform == SPLIT_FLOAT16 else width
    count = 1 + plane_count * per_plane
    _need(stored, _PREAMBLE.size + count * _ENTRY.size)
    source = np.frombuffer(stored, np.uint8)
    table = _scratch_table(count)
    decoded = _scratch("huffman", elements * plane_count) if decode else np.empty(0, np.uint8)  # no plane segment exceeds its N bytes
    split = transform == SPLIT_FLOAT16
    status = _read_frames(source, count, header_len, elements, segment, per_plane, split, max(METHODS[version]), table, decoded, decode)
    if status == _LENGTHS_DIFFER:
        raise IntegrityError("byte-plane container length does not match its frame table")
    if status == _UNKNOWN_METHOD:
        raise IntegrityError(f"unknown byte-plane frame method {int(table[:, 0].max())} (container version {version})")
    if status:
        raise IntegrityError(f"{huffman.ERRORS[status % 16]} (frame {status // 16 - 1})")
    method, start, stop = (int(v) for v in table[0, :3])
    header = _frame(method, stored[start:stop], header_len, _decompressor())
    frames = FrameTable(version, width, transform, header, elements, segment, per_plane, plane_count, table)
    return frames, decoded


def frame_table(stored: bytes | bytearray | memoryview, max_plain_bytes: int, version: int) -> FrameTable:
    """The frame table of a version 2 or 3 container (``version``, the pack's codec's), read and checked as
    ``decode_planes`` does, without decoding a plane frame (IntegrityError on a malformed container). The table is a
    new array; ``header`` may be a view of ``stored``."""
    stored = memoryview(stored)
    _need(stored, 5)
    if bytes(stored[:4]) != MAGIC or stored[4] not in (2, 3):
        raise IntegrityError("not a byte-plane container of a known version")
    if stored[4] != version:
        raise IntegrityError(f"byte-plane container version {stored[4]}, where the pack's codec has version {version}")
    frames, _ = _segmented_table(stored, max_plain_bytes, version, decode=False)
    return dataclasses.replace(frames, table=frames.table.copy())


def frame_bytes(method: int, body: memoryview, plain_len: int) -> bytes | memoryview:
    """The plain bytes of a raw or zstd frame (``body`` itself when raw), checked against ``plain_len``."""
    return _frame(method, body, plain_len, _decompressor())


def _planes_segmented(stored: memoryview, max_plain_bytes: int, version: int) -> Planes:
    """Container versions 2 and 3: planes in segments, every frame's plain length implied by the preamble."""
    frames, decoded = _segmented_table(stored, max_plain_bytes, version, decode=True)
    decompressor = _decompressor()
    parts: list[np.ndarray] = []  # the planes' segments, plane by plane
    for method, start, stop, plain, at in frames.table[1:].tolist():
        if method == HUFFMAN:  # never frame 0, the header (_read_frames refuses it)
            parts.append(decoded[at : at + plain])
        else:
            parts.append(np.frombuffer(_frame(method, stored[start:stop], plain, decompressor), dtype=np.uint8))
    per_plane = frames.per_plane
    planes = [parts[j * per_plane : (j + 1) * per_plane] for j in range(frames.plane_count)]
    return Planes(frames.header, planes, frames.segment, frames.elements, frames.element_size, frames.transform)


_LENGTHS_DIFFER, _UNKNOWN_METHOD = 1, 2


@njit(nogil=True, cache=True)
def _read_frames(
    source: np.ndarray, count: int, header_len: int, elements: int, segment: int, per_plane: int, split: bool, max_method: int,
    table: np.ndarray, decoded: np.ndarray, decode: bool,
) -> int:  # pragma: no cover - compiled
    """Read a version 2/3 container's frame table (the caller checked that it is there) into ``table``: per frame its
    method, stored range, plain length and, a Huffman frame, where its plain bytes go in ``decoded`` (end to end); then,
    once every frame is known to lie in the container, decode every Huffman frame into ``decoded`` (without ``decode``:
    only check each one's size, code lengths and stream table, ``huffman.check_frame``). Returns 0,
    _LENGTHS_DIFFER, _UNKNOWN_METHOD, or 16 * (frame index + 1) + the Huffman error's code. One compiled call per chunk:
    its frames are read and decoded without a Python step each."""
    offset, at, status = np.int64(23 + 5 * count), 0, 0  # past the preamble and the table
    for i in range(count):
        entry = 23 + 5 * i
        method = np.int64(source[entry])
        stored = (
            np.int64(source[entry + 1])
            | (np.int64(source[entry + 2]) << 8)
            | (np.int64(source[entry + 3]) << 16)
            | (np.int64(source[entry + 4]) << 24)
        )
        if i == 0:
            plain = header_len
        else:
            size = min(segment, elements - ((i - 1) % per_plane) * segment)
            plain = packed_length(size) if split and (i - 1) // per_plane == 2 else size
        table[i, 0], table[i, 1], table[i, 2], table[i, 3], table[i, 4] = method, offset, offset + stored, plain, at
        offset += stored
        if method > max_method or (i == 0 and method == HUFFMAN):
            status = _UNKNOWN_METHOD
        elif method == HUFFMAN:
            at += plain
    if offset != len(source):
        return _LENGTHS_DIFFER
    if status:
        return status
    single_symbol = np.empty(huffman.TABLE, np.uint8)
    single_length = np.empty(huffman.TABLE, np.uint8)
    lookups = np.empty(huffman.TABLE, np.uint64)
    for i in range(count):
        if table[i, 0] == HUFFMAN and not decode:
            found = huffman.check_frame(source, table[i, 1], table[i, 2])
            if found:
                return 16 * (i + 1) + found
        elif table[i, 0] == HUFFMAN:
            found = huffman.decode_frame(
                source, table[i, 1], table[i, 2], decoded, table[i, 4], table[i, 3], single_symbol, single_length, lookups
            )
            if found:
                return 16 * (i + 1) + found
    return 0


def _compressor() -> zstandard.ZstdCompressor:
    """This thread's level-1 zstd compressor, kept (as its decompressor): a fresh one sets up a context per chunk."""
    found = _SCRATCH.__dict__.get("compressor")
    if found is None:
        found = _SCRATCH.compressor = zstandard.ZstdCompressor(level=1)
    return found


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor, kept: making one allocates and sets up a fresh context for every chunk."""
    found = _SCRATCH.__dict__.get("decompressor")
    if found is None:
        found = _SCRATCH.decompressor = zstandard.ZstdDecompressor()
    return found


def _scratch(name: object, size: int) -> np.ndarray:
    """This thread's reusable buffer ``name``, ``size`` bytes long (a new one past ``MAX_SCRATCH``, so that one
    huge chunk does not pin its size in every thread)."""
    if size > MAX_SCRATCH:
        return np.empty(size, dtype=np.uint8)
    buffers: dict[object, np.ndarray] = _SCRATCH.__dict__.setdefault("buffers", {})
    if name not in buffers or len(buffers[name]) < size:
        buffers[name] = np.empty(size, dtype=np.uint8)
    return buffers[name][:size]


def _scratch_table(count: int) -> np.ndarray:
    """This thread's reusable frame table, ``count`` rows of (method, start, stop, plain length, place)."""
    return _scratch("table", count * 40).view(np.int64).reshape(count, 5)


def _scratch_plane(index: int, elements: int) -> np.ndarray:
    """This thread's reusable buffer for joining plane ``index`` across segments."""
    return _scratch(index, elements)


def decode_planes(stored: bytes | bytearray | memoryview, max_plain_bytes: int, version: int | None = None) -> Planes:
    """Decompress a container's frames (not yet joined); raise IntegrityError on a malformed container, or one
    of another container ``version`` than the one given (the pack's codec names it).

    The declared plain lengths are checked against ``max_plain_bytes`` before anything is
    decompressed, and no frame may decompress past its declared length: a container cannot make
    the reader allocate more than the caller allows.
    """
    stored = memoryview(stored)
    _need(stored, 5)
    magic, found = bytes(stored[:4]), stored[4]
    if magic != MAGIC or found not in (1, 2, 3):
        raise IntegrityError("not a byte-plane container of a known version")
    if version is not None and found != version:
        raise IntegrityError(f"byte-plane container version {found}, where the pack's codec has version {version}")
    return _planes_v1(stored, max_plain_bytes) if found == 1 else _planes_segmented(stored, max_plain_bytes, found)


def decode(stored: bytes | memoryview, max_plain_bytes: int) -> memoryview:
    """Invert ``encode`` exactly, into one new buffer (not zeroed first: every byte is written); raise
    IntegrityError on a malformed container (see ``decode_planes``)."""
    planes = decode_planes(stored, max_plain_bytes)
    split, width = len(planes.header), planes.element_size
    room = np.empty(split + planes.elements * width + _ALIGN, dtype=np.uint8)
    start = -(room.__array_interface__["data"][0] + split) % _ALIGN  # the elements start aligned, and so the join's stores
    out = room[start : start + split + planes.elements * width]
    out[:split] = np.frombuffer(planes.header, dtype=np.uint8)
    data = out[split:].view(_UNSIGNED[width])
    for start in range(0, planes.elements, planes.segment):  # a segment at a time: each joined from where it lies
        count = min(planes.segment, planes.elements - start)
        planes.write(data[start : start + count].reshape(1, 1, count), start, (1, 1, count))
    return out.data
