"""Byte-plane codec: lossless compression of tensor bytes that plain zstd handles poorly.

Float elements compress badly as a byte stream because their low mantissa bytes are noise
interleaved with well-behaved exponent bytes. This codec splits a safetensors blob into its
header and, per byte position of the element, one *plane* (plane j holds byte j of every
element, little-endian). Container version 2 (codec ``byteplane-zstd-2``, written now) first
rotates float32 and bfloat16 elements left by one bit, so that the last plane holds exactly the
8-bit exponent and the sign joins the noisy mantissa; it codes each plane in segments that end
where the chunk's tensors do (at least 64 KiB), each the smaller of a zstd frame that only entropy-codes its bytes (Huffman literals, as ZipNN
does), a level-1 zstd frame, and the raw bytes. Container version 1 (``byteplane-zstd``, packs
written before) coded each plane whole at level 1 and still decodes. See docs/format.md §1.4.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from packstore.errors import IntegrityError
from packstore.format.body import tensor_table
from packstore.format.header import DTYPE_SIZES
from packstore.format.interleave import join_planes

MAGIC = b"PSBP"
RAW, ZSTD = 0, 1
RAW_THRESHOLD = 0.98  # a frame that saves less than 2 % is stored raw
SEGMENT = 1 << 16  # fewest plain bytes per coded piece of a plane (v2) that writers use
WRITE_SEGMENT_LIMIT = 1 << 20  # most plain bytes per piece that writers use
MAX_SEGMENT = 1 << 24  # most that readers accept
ROTATED = frozenset({"float32", "bfloat16"})  # their 8-bit exponent straddles two bytes until rotated
NO_TRANSFORM, ROTATE_LEFT_1 = 0, 1
_V1 = struct.Struct("<4sBBB")  # magic, version 1, element size, frame count
_V1_FRAME = struct.Struct("<BQQ")  # method, plain length, stored length
_V2 = struct.Struct("<4sBBBIQI")  # magic, version 2, element size, transform, header length, elements, segment
_V2_FRAME = struct.Struct("<BI")  # method, stored length
_UNSIGNED = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
MAX_SCRATCH = 1 << 26  # bytes of a joined plane range kept for reuse per thread (real tensors' are a few MB at most)
_SCRATCH = threading.local()  # per thread: buffers for plane ranges that span segments, and a decompressor


def _entropy_only() -> zstandard.ZstdCompressor:
    """zstd that finds (almost) no matches: a plane segment becomes Huffman-coded literals, which decode fast."""
    params = zstandard.ZstdCompressionParameters(
        window_log=17, chain_log=6, hash_log=6, search_log=1, min_match=7, target_length=0, strategy=zstandard.STRATEGY_FAST
    )
    return zstandard.ZstdCompressor(compression_params=params)


def _code_frame(plain: bytes | memoryview, compressors: list[zstandard.ZstdCompressor]) -> tuple[int, bytes]:
    """The smallest of ``plain`` coded by each compressor, or ``plain`` itself when none saves 2 %."""
    coded = min((c.compress(plain) for c in compressors), key=len)
    if len(coded) >= RAW_THRESHOLD * len(plain):
        return RAW, bytes(plain)
    return ZSTD, coded


def safetensors_split(blob: bytes | memoryview) -> int:
    """Length of a safetensors blob's header (8-byte size + JSON); the tensor data follows it."""
    if len(blob) < 8:
        raise IntegrityError("safetensors blob is shorter than its size field")
    return 8 + struct.unpack_from("<Q", blob)[0]


def segment_for(tensor_elements: list[int]) -> int:
    """Plain bytes per plane segment for tensors of these element counts: the smallest multiple of their common
    size (gcd) that is at least SEGMENT, at most WRITE_SEGMENT_LIMIT. Segments then end at tensor boundaries, so
    each of a chunk's K and V tensors gets its own Huffman tables, and a chunk has few segments to decode."""
    common = math.gcd(*tensor_elements) or SEGMENT
    return min(WRITE_SEGMENT_LIMIT, common * -(-SEGMENT // common))


def encode(blob: bytes, dtype: str, segment: int | None = None) -> bytes:
    """Compress a safetensors blob whose tensors are all of ``dtype`` (container version 2), in segments of
    ``segment`` elements (None: ``segment_for`` the blob's tensors, read strictly)."""
    width = DTYPE_SIZES[dtype]
    split = safetensors_split(blob)
    if (len(blob) - split) % width:
        raise ValueError(f"tensor data of {len(blob) - split} bytes is not a whole number of {width}-byte elements")
    elements = np.frombuffer(blob, dtype=_UNSIGNED[width], offset=split)
    transform = ROTATE_LEFT_1 if dtype in ROTATED else NO_TRANSFORM
    if transform == ROTATE_LEFT_1:
        elements = (elements << 1) | (elements >> (8 * width - 1))
    as_bytes = elements.view(np.uint8).reshape(-1, width)
    if segment is None:
        segment = segment_for([(t.stop - t.start) // width for t in tensor_table(blob)])
    if not 0 < segment <= MAX_SEGMENT:
        raise ValueError(f"segment {segment} is outside 1 .. {MAX_SEGMENT}")
    compressors = [_entropy_only(), zstandard.ZstdCompressor(level=1)]
    frames = [_code_frame(memoryview(blob)[:split], compressors)]
    for j in range(width):
        plane = np.ascontiguousarray(as_bytes[:, j]).data
        frames += [_code_frame(plane[s : s + segment], compressors) for s in range(0, len(plane), segment)]
    preamble = _V2.pack(MAGIC, 2, width, transform, split, len(elements), segment)
    table = b"".join(_V2_FRAME.pack(method, len(body)) for method, body in frames)
    return b"".join([preamble, table] + [body for _, body in frames])


@dataclass(frozen=True)
class Planes:
    """A container's frames once decompressed: the safetensors header, and per byte of the element one plane
    (byte j of every element), each held as the segments it was coded in: element ``i`` of plane ``j`` is
    ``segments[j][i // segment][i % segment]``. A segment is its decompressed bytes or, when stored raw, a view
    of the container. ``rotated``: elements were rotated left by one bit before the split. ``write`` puts
    elements back together wherever they belong, straight from the segments when a tensor lies within one
    (writers end segments at tensor boundaries), so planes are never first copied whole."""

    header: bytes | memoryview
    segments: list[list[np.ndarray]]
    segment: int
    elements: int
    element_size: int
    rotated: bool

    def plane(self, index: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``start`` to ``stop`` (the end when None) of plane ``index``: a view of one segment when they
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

    def write(self, out: np.ndarray, first: int, shape: tuple[int, int, int], offset: int = 0, count: int | None = None) -> None:
        """Join elements ``first`` onwards, seen as an array of ``shape`` ``[A, T, D]``, into ``out``: a C-contiguous
        ``[A, P, D]`` array of uint16/uint32 (the bytes of a whole tensor). Positions ``0 .. count-1`` (all ``T``
        when None) go to ``out[:, offset : offset + count]``, so a token block lands in its place in the layer."""
        stop = first + shape[0] * shape[1] * shape[2]
        planes = [self.plane(j, first, stop) for j in range(self.element_size)]
        join_planes(planes, shape, out, offset, shape[1] if count is None else count, self.rotated)


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
    return Planes(header, [[np.frombuffer(plane, dtype=np.uint8)] for plane in planes], max(elements, 1), elements, width, rotated=False)


def _planes_v2(stored: memoryview, max_plain_bytes: int) -> Planes:
    _need(stored, _V2.size)
    _, _, width, transform, header_len, elements, segment = _V2.unpack_from(stored)
    if width not in _UNSIGNED or transform not in (NO_TRANSFORM, ROTATE_LEFT_1) or not 0 < segment <= MAX_SEGMENT:
        raise IntegrityError(f"byte-plane container version 2 with {width}-byte elements, transform {transform}, segment {segment}")
    _check_declared(header_len + elements * width, max_plain_bytes)
    per_plane = math.ceil(elements / segment)
    offset = _V2.size + (1 + width * per_plane) * _V2_FRAME.size
    _need(stored, offset)
    frames = list(_V2_FRAME.iter_unpack(stored[_V2.size : offset]))
    if offset + sum(f[1] for f in frames) != len(stored):
        raise IntegrityError("byte-plane container length does not match its frame table")
    decompressor = _decompressor()
    (method, stored_len) = frames[0]
    header = _frame(method, stored[offset : offset + stored_len], header_len, decompressor)
    offset += stored_len
    planes = []
    for j in range(width):
        segments = []
        for s, (method, stored_len) in zip(range(0, elements, segment), frames[1 + j * per_plane : 1 + (j + 1) * per_plane]):
            part = _frame(method, stored[offset : offset + stored_len], min(segment, elements - s), decompressor)
            segments.append(np.frombuffer(part, dtype=np.uint8))
            offset += stored_len
        planes.append(segments)
    return Planes(header, planes, segment, elements, width, rotated=transform == ROTATE_LEFT_1)


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor, kept: making one allocates and sets up a fresh context, about 8 µs
    (4 % of decoding a 2-byte chunk of 196,608-element tensors here)."""
    found = _SCRATCH.__dict__.get("decompressor")
    if found is None:
        found = _SCRATCH.decompressor = zstandard.ZstdDecompressor()
    return found


def _scratch_plane(index: int, elements: int) -> np.ndarray:
    """This thread's reusable buffer for plane ``index``, ``elements`` bytes long (a new one past
    ``MAX_SCRATCH``, so that one huge tensor does not pin its size in every thread)."""
    if elements > MAX_SCRATCH:
        return np.empty(elements, dtype=np.uint8)
    buffers = _SCRATCH.__dict__.setdefault("planes", {})
    if len(buffers.get(index, ())) < elements:
        buffers[index] = np.empty(elements, dtype=np.uint8)
    return buffers[index][:elements]


def decode_planes(stored: bytes | memoryview, max_plain_bytes: int, version: int | None = None) -> Planes:
    """Decompress a container's frames (not yet joined); raise IntegrityError on a malformed container, or one
    of another container ``version`` than the one given (the pack's codec names it).

    The declared plain lengths are checked against ``max_plain_bytes`` before anything is
    decompressed, and no frame may decompress past its declared length: a container cannot make
    the reader allocate more than the caller allows.
    """
    stored = memoryview(stored)
    _need(stored, 5)
    magic, found = bytes(stored[:4]), stored[4]
    if magic != MAGIC or found not in (1, 2):
        raise IntegrityError("not a byte-plane container of a known version")
    if version is not None and found != version:
        raise IntegrityError(f"byte-plane container version {found}, where the pack's codec has version {version}")
    return _planes_v1(stored, max_plain_bytes) if found == 1 else _planes_v2(stored, max_plain_bytes)


def decode(stored: bytes | memoryview, max_plain_bytes: int) -> memoryview:
    """Invert ``encode`` exactly, into one new buffer (not zeroed first: every byte is written); raise
    IntegrityError on a malformed container (see ``decode_planes``)."""
    planes = decode_planes(stored, max_plain_bytes)
    split, width = len(planes.header), planes.element_size
    out = np.empty(split + planes.elements * width, dtype=np.uint8)
    out[:split] = np.frombuffer(planes.header, dtype=np.uint8)
    data = out[split:].view(_UNSIGNED[width])
    for start in range(0, planes.elements, planes.segment):  # a segment at a time: each joined from where it lies
        count = min(planes.segment, planes.elements - start)
        planes.write(data[start : start + count].reshape(1, 1, count), start, (1, 1, count))
    return out.data
