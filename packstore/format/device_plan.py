"""A chunk planned for decoding on a device: the CPU checks it and says where every frame's bytes go, the device
decodes them (``packstore.format.huffman_cuda``) and joins the planes (``packstore.packs.plane_join``).

The CPU's share is what it must do before anything is sent: the chunk's digest (``body.verify_chunk``, through
``plan_chunk`` unless the caller verified it), its container's preamble and frame table (``codec.frame_table``: the
same checks as the CPU decoder, each Huffman frame's code lengths and stream table included), its safetensors table
(``chunks.chunk_tensors``, the same rules as every reader), and the frames no device kernel decodes: a zstd frame (the
first layers' repeated rows) is decompressed here. The device's input is then the chunk's stored bytes followed by
those decompressed frames, and its output the chunk's *plane bytes*: plane 0's segments end to end, then plane 1's, and
so on (for the float16 split, plane 2's packed segments), each frame decoded (Huffman) or copied (raw, zstd) into place.

A chunk the device path does not take is decoded on the host as before and its elements sent as they are
(``plan_chunk`` returns None): a container of version 1 (codec ``byteplane-zstd``: whole zstd planes, nothing for a
Huffman kernel), and a float16 split whose segments are not a multiple of 256 elements with a tensor across two of them
(no writer makes one: writers end segments at tensor boundaries). Every pack is therefore decoded exactly, whatever its
codec, dtype or container. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packstore.errors import IntegrityError
from packstore.format import codec
from packstore.format.body import TensorEntry, max_plain_bytes, verify_chunk
from packstore.format.chunks import Buffer, check_codec, chunk_tensors
from packstore.format.header import CODECS, PackHeader
from packstore.format.interleave import PACKED_GROUP

COPY, DECODE = codec.RAW, codec.HUFFMAN  # a device frame's method: copied into place as it is, or Huffman-decoded
FRAME_COLUMNS = 5  # a device frame: method, start and stop in the input, place in the plane bytes, plain bytes


@dataclass(frozen=True)
class TensorPlanes:
    """Where one tensor's planes lie in its chunk's plane bytes: each plane's ``[start, stop)``; for the float16 split
    also its packed plane, ``(start, stop, the element there of the tensor's first, the elements it covers)``."""

    entry: TensorEntry
    planes: tuple[tuple[int, int], ...]
    packed: tuple[int, int, int, int] | None


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk ``index`` planned for the device. ``inputs``: the pieces of the device's input, end to end (the stored
    bytes, then each zstd frame decompressed), ``input_bytes`` long; ``frames``: one row per plane frame (``FRAME_COLUMNS``
    int64: method COPY or DECODE, start and stop in the input, place and length in the plane bytes), offsets relative to
    the chunk's own input and plane bytes; ``tensors``: where each tensor's planes end up; ``positions`` and ``block``
    as ``chunks.OpenedChunk``; ``rotated``: undo the codec's rotation when joining."""

    index: int
    inputs: tuple[Buffer, ...]
    input_bytes: int
    frames: np.ndarray
    plane_bytes: int
    tensors: tuple[TensorPlanes, ...]
    positions: range
    block: tuple[int, int, int]
    rotated: bool
    element_size: int


def plan_chunk(header: PackHeader, index: int, data: Buffer, *, verified: bool = False) -> ChunkPlan | None:
    """Check chunk ``index`` (its digest unless ``verified``, its container and its tensor table: IntegrityError as the
    CPU decoder raises it) and plan its frames for the device; None when the device path does not take it (see the
    module's docstring), once its digest is checked: the caller decodes it on the host (``verified=True``)."""
    check_codec(header)
    info = header.chunks[index]
    if not verified:
        verify_chunk(header, index, data)
    version = CODECS[header.codec]
    if version == 1:
        return None
    stored = memoryview(data)
    try:
        frames = codec.frame_table(stored, max_plain_bytes(info), version)
        inputs: list[Buffer] = [stored]
        extra = len(stored)
        rows = np.zeros((len(frames.table) - 1, FRAME_COLUMNS), np.int64)
        bases = [0]
        for plane in range(frames.plane_count):
            bases.append(bases[-1] + frames.plane_bytes(plane))
        for i, (method, start, stop, plain, _) in enumerate(frames.table[1:].tolist()):
            plane, segment = divmod(i, frames.per_plane)
            place = bases[plane] + segment * frames.plane_bytes(plane, 0)
            if method == codec.ZSTD:  # decompressed here; the device copies it into place
                part = codec.frame_bytes(method, stored[start:stop], plain)
                inputs.append(part)
                start, stop, extra = extra, extra + plain, extra + plain
            elif method == codec.RAW and stop - start != plain:
                raise IntegrityError("byte-plane raw frame has the wrong length")
            rows[i] = (DECODE if method == codec.HUFFMAN else COPY, start, stop, place, plain)
    except IntegrityError as exc:
        raise IntegrityError(f"pack {header.key}: chunk {index} cannot be decoded: {exc}") from None
    entries, positions, block = chunk_tensors(header, index, frames.header, frames.elements * frames.element_size)
    tensors = []
    for entry in entries:
        placed = _tensor_planes(frames, bases, entry)
        if placed is None:
            return None
        tensors.append(placed)
    return ChunkPlan(
        index, tuple(inputs), extra, rows, bases[-1], tuple(tensors), positions, block, frames.transform == codec.ROTATE_LEFT_1,
        frames.element_size,
    )


def _tensor_planes(frames: codec.FrameTable, bases: list[int], entry: TensorEntry) -> TensorPlanes | None:
    """Where ``entry``'s planes lie in the plane bytes (planes start at ``bases``); None for a float16 split tensor
    across two segments whose packed planes do not join into one (segments not a multiple of PACKED_GROUP)."""
    first = entry.start // frames.element_size
    elements = (entry.stop - entry.start) // frames.element_size
    if frames.transform != codec.SPLIT_FLOAT16:
        return TensorPlanes(entry, tuple((bases[j] + first, bases[j] + first + elements) for j in range(frames.plane_count)), None)
    planes = ((bases[0] + first, bases[0] + first + elements), (bases[1] + first, bases[1] + first + elements))
    if frames.segment % PACKED_GROUP == 0:  # the packed segments end to end are the whole plane packed at once
        return TensorPlanes(entry, planes, (bases[2], bases[3], first, frames.elements))
    segment = first // frames.segment
    if elements and (first + elements - 1) // frames.segment != segment:
        return None
    start = bases[2] + segment * frames.plane_bytes(2, 0)
    return TensorPlanes(entry, planes, (start, start + frames.plane_bytes(2, segment), first - segment * frames.segment,
                                        frames.plane_bytes(0, segment)))


def gather(plans: list[ChunkPlan]) -> tuple[list[int], list[int], np.ndarray]:
    """Chunks decoded together (one copy, one kernel launch): each chunk's input and plane bytes laid end to end, and
    every frame of them with its offsets made absolute. Returns the input offsets, the plane offsets (each list one
    longer than ``plans``: its last entry is the total) and the frames (``FRAME_COLUMNS`` int64 each)."""
    inputs, planes, rows = [0], [0], []
    for plan in plans:
        shifted = plan.frames.copy()
        shifted[:, 1:3] += inputs[-1]
        shifted[:, 3] += planes[-1]
        rows.append(shifted)
        inputs.append(inputs[-1] + plan.input_bytes)
        planes.append(planes[-1] + plan.plane_bytes)
    frames = np.concatenate(rows) if rows else np.zeros((0, FRAME_COLUMNS), np.int64)
    return inputs, planes, frames
