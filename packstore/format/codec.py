"""Byte-plane codec: lossless compression of tensor bytes that plain zstd handles poorly.

Float elements compress badly as a byte stream because their low mantissa bytes are noise
interleaved with well-behaved exponent bytes. This codec splits a safetensors blob into its
header and, per byte position of the element, one *plane* (plane j holds byte j of every
element, little-endian, so the last plane holds the sign and high exponent bits). Each part is
coded as an independent zstd frame, or kept raw when zstd saves less than ``RAW_THRESHOLD``.
Container layout (all integers little-endian), see docs/format.md §1.4:

    magic b"PSBP" | version u8 = 1 | element_size u8 | frame_count u8
    frame_count x (method u8: 0 raw, 1 zstd | plain_len u64 | stored_len u64)
    frame bytes, in order: safetensors header, plane 0 .. plane element_size-1
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from packstore.errors import IntegrityError

MAGIC = b"PSBP"
VERSION = 1
RAW, ZSTD = 0, 1
RAW_THRESHOLD = 0.98
DEFAULT_LEVEL = 1  # on real KV planes, level 1 compresses better than 3 (bf16 1.47 vs 1.42) and faster
_PREAMBLE = struct.Struct("<4sBBB")
_FRAME = struct.Struct("<BQQ")


def _code_frame(plain: bytes | memoryview, compressor: zstandard.ZstdCompressor) -> tuple[int, bytes]:
    coded = compressor.compress(plain)
    if len(coded) >= RAW_THRESHOLD * len(plain):
        return RAW, bytes(plain)
    return ZSTD, coded


def safetensors_split(blob: bytes) -> int:
    """Length of a safetensors blob's header (8-byte size + JSON); the tensor data follows it."""
    if len(blob) < 8:
        raise IntegrityError("safetensors blob is shorter than its size field")
    return 8 + struct.unpack_from("<Q", blob)[0]


def encode(blob: bytes, element_size: int, level: int = DEFAULT_LEVEL) -> bytes:
    """Compress a safetensors blob whose tensors all have ``element_size``-byte elements."""
    split = safetensors_split(blob)
    data = np.frombuffer(blob, dtype=np.uint8, offset=split)
    if data.size % element_size:
        raise ValueError(f"tensor data of {data.size} bytes is not a whole number of {element_size}-byte elements")
    elements = data.reshape(-1, element_size)
    parts: list[bytes | memoryview] = [memoryview(blob)[:split]]
    parts += [np.ascontiguousarray(elements[:, j]).data for j in range(element_size)]
    compressor = zstandard.ZstdCompressor(level=level)
    coded = [_code_frame(part, compressor) for part in parts]
    table = b"".join(_FRAME.pack(method, len(part), len(body)) for (method, body), part in zip(coded, parts))
    return b"".join([_PREAMBLE.pack(MAGIC, VERSION, element_size, len(parts)), table] + [body for _, body in coded])


@dataclass(frozen=True)
class Planes:
    """A container's frames once decompressed: the safetensors header, and one plane per byte of the element
    (all of one length, the number of elements). ``write`` puts elements back together wherever they belong."""

    header: bytes | memoryview
    planes: list[np.ndarray]
    element_size: int

    @property
    def elements(self) -> int:
        return len(self.planes[0])

    def write(self, out: np.ndarray, first: int, shape: tuple[int, ...], pick: tuple = ()) -> None:
        """Interleave elements ``first`` onwards, seen as an array of ``shape`` and indexed by ``pick`` (e.g. the
        first positions of a token block), into ``out``: uint8 of that shape plus a last axis of ``element_size``
        bytes, which may be a strided view (a block's place in a whole layer), so nothing is copied twice."""
        count = int(np.prod(shape, dtype=np.int64))
        arrays = [plane[first : first + count].reshape(shape)[pick] for plane in self.planes]
        if self.element_size == 2:  # one vectorized shift-or into the destination, no strided byte writes
            target = out.view("<u2")[..., 0]
            np.left_shift(arrays[1], 8, out=target, dtype="<u2")
            np.bitwise_or(target, arrays[0], out=target)
            return
        for j, plane in enumerate(arrays):
            out[..., j] = plane


def decode_planes(stored: bytes | memoryview, max_plain_bytes: int) -> Planes:
    """Decompress a container's frames (not yet interleaved); raise IntegrityError on a malformed container.

    The frame table's plain lengths are checked against ``max_plain_bytes`` before anything is
    decompressed, and no frame may decompress past its declared length: a container cannot make
    the reader allocate more than the caller allows.
    """
    try:
        magic, version, element_size, count = _PREAMBLE.unpack_from(stored)
    except struct.error:
        raise IntegrityError("byte-plane container is truncated") from None
    if magic != MAGIC or version != VERSION or count != element_size + 1 or element_size == 0:
        raise IntegrityError("not a byte-plane container of a known version")
    offset = _PREAMBLE.size + count * _FRAME.size
    if len(stored) < offset:
        raise IntegrityError("byte-plane container is truncated")
    frames = [_FRAME.unpack_from(stored, _PREAMBLE.size + i * _FRAME.size) for i in range(count)]
    if offset + sum(f[2] for f in frames) != len(stored):
        raise IntegrityError("byte-plane container length does not match its frame table")
    declared = sum(f[1] for f in frames)
    if declared > max_plain_bytes:
        raise IntegrityError(f"byte-plane container declares {declared} plain bytes, more than the {max_plain_bytes} allowed")
    decompressor = zstandard.ZstdDecompressor()
    parts = []
    for method, plain_len, stored_len in frames:
        body = memoryview(stored)[offset : offset + stored_len]
        offset += stored_len
        if method == RAW:
            part = body
        elif method == ZSTD:
            try:
                part = decompressor.decompress(body, max_output_size=plain_len)
            except zstandard.ZstdError as exc:
                raise IntegrityError(f"byte-plane frame cannot be decompressed: {exc}") from None
        else:
            raise IntegrityError(f"unknown byte-plane frame method {method}")
        if len(part) != plain_len:
            raise IntegrityError("byte-plane frame has the wrong decoded length")
        parts.append(part)
    header, planes = parts[0], parts[1:]
    if len({len(p) for p in planes}) != 1:
        raise IntegrityError("byte-plane planes differ in length")
    return Planes(header, [np.frombuffer(plane, dtype=np.uint8) for plane in planes], element_size)


def decode(stored: bytes | memoryview, max_plain_bytes: int) -> bytearray:
    """Invert ``encode`` exactly, into one new buffer; raise IntegrityError on a malformed container (see ``decode_planes``)."""
    planes = decode_planes(stored, max_plain_bytes)
    split, width = len(planes.header), planes.element_size
    out = bytearray(split + planes.elements * width)
    out[:split] = planes.header
    if planes.elements:
        planes.write(np.frombuffer(out, dtype=np.uint8, offset=split).reshape(-1, width), 0, (planes.elements,))
    return out
