"""One stored chunk opened: its planes decoded and its tensor table checked against the header, without torch.

Every reader of chunks goes through ``open_chunk``: the pack reader's ``verify`` (which joins the planes into
numpy arrays here, so verifying needs no torch) and the torch side's assembler (which joins them straight into
its tensors), so a chunk is accepted by exactly one set of rules.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from packstore.errors import IntegrityError
from packstore.format import codec
from packstore.format.body import TensorEntry, chunk_tensor_names, data_table, describe_chunk, max_plain_bytes, verify_chunk
from packstore.format.header import CODECS, DTYPE_SIZES, PackHeader

Buffer = bytes | bytearray | memoryview
# A pack's chunks as a backend hands them out: a context yielding (index, stored bytes), in the order asked for;
# the bytes may be views (of an LMDB map, a receive buffer) good only until the context ends.
ChunkSource = Callable[[], AbstractContextManager[Iterable[tuple[int, Buffer]]]]
UNSIGNED = {2: np.uint16, 4: np.uint32}  # element width -> the unsigned integers elements are joined as


@dataclass(frozen=True)
class OpenedChunk:
    """A chunk whose planes are decoded (views of the decoding thread's scratch: good until that thread decodes
    another) and whose tensors are exactly its layers' K and V in the header's dtype and shape.

    ``positions``: the token positions it holds (a knowledge pack's; a whole-tensor pack's are ``range(0, 1)``);
    ``block``: each tensor seen as ``[A, P, D]`` with positions on the middle axis."""

    index: int
    planes: codec.Planes
    entries: tuple[TensorEntry, ...]
    positions: range
    block: tuple[int, int, int]

    def first_element(self, entry: TensorEntry) -> int:
        """Where ``entry``'s elements start among the chunk's elements."""
        return entry.start // self.planes.element_size


def as_3d(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``shape`` as ``[A, P, D]``: leading axes merged, positions (the second-to-last axis) and the last kept."""
    padded = (1, 1, *shape)
    return math.prod(padded[:-2]), padded[-2], padded[-1]


def open_chunk(header: PackHeader, index: int, data: Buffer, *, verified: bool = False) -> OpenedChunk:
    """Check chunk ``index`` against its digest (unless ``verified``), decode its planes and check its tensor table:
    IntegrityError if it is damaged or does not hold exactly its layers' tensors in the header's shape and dtype."""
    check_codec(header)
    info = header.chunks[index]
    if not verified:
        verify_chunk(header, index, data)
    try:
        planes = codec.decode_planes(data, max_plain_bytes(info), CODECS[header.codec])
    except IntegrityError as exc:
        raise IntegrityError(f"pack {header.key}: chunk {index} cannot be decoded: {exc}") from None
    entries, positions, block = chunk_tensors(header, index, planes.header, planes.elements * planes.element_size)
    return OpenedChunk(index, planes, entries, positions, block)


def check_codec(header: PackHeader) -> None:
    """IntegrityError unless the pack's codec is one this reader decodes."""
    if header.codec not in CODECS:
        raise IntegrityError(f"pack {header.key}: unknown codec {header.codec!r}")


def chunk_tensors(
    header: PackHeader, index: int, table: Buffer, data_bytes: int
) -> tuple[tuple[TensorEntry, ...], range, tuple[int, int, int]]:
    """Chunk ``index``'s tensors from its safetensors header ``table`` over ``data_bytes`` of tensor data, checked to be
    exactly its layers' K and V in the header's shape and dtype (IntegrityError otherwise), with the positions it holds
    and each tensor's ``[A, P, D]`` shape (``OpenedChunk``): the checks every decoder of a chunk makes on its table."""
    try:
        entries = data_table(table, data_bytes)
    except IntegrityError as exc:
        raise IntegrityError(f"pack {header.key}: chunk {index} cannot be decoded: {exc}") from None
    info = header.chunks[index]
    if {entry.name for entry in entries} != chunk_tensor_names(header, info):
        raise IntegrityError(f"pack {header.key}: chunk {index} does not hold exactly the tensors of {describe_chunk(info)}")
    held = info.positions_held(header.positions)
    shape = (header.kv_heads, len(held), header.head_dim) if header.kind == "knowledge" else header.tensor_shape
    for entry in entries:
        if entry.dtype != header.dtype or entry.shape != shape:
            raise IntegrityError(
                f"pack {header.key}: chunk {index} tensor {entry.name!r} is {entry.shape} {entry.dtype}, "
                f"the header says {shape} {header.dtype}"
            )
    return tuple(entries), held if header.kind == "knowledge" else range(0, 1), as_3d(shape)


def chunk_arrays(header: PackHeader, index: int, data: Buffer, *, verified: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of chunk ``index`` decoded into a new numpy array of unsigned integers of its element width,
    shaped ``[A, P, D]`` (``open_chunk``'s checks first): what verifying a pack decodes, without torch."""
    chunk = open_chunk(header, index, data, verified=verified)
    unsigned = UNSIGNED[DTYPE_SIZES[header.dtype]]
    arrays = {}
    for entry in chunk.entries:
        out = np.empty(chunk.block, dtype=unsigned)
        chunk.planes.write(out, chunk.first_element(entry), chunk.block, 0, chunk.block[1])
        arrays[entry.name] = out
    return arrays


def adapter_digest(header_embeddings: Buffer, trailer_embeddings: Buffer) -> str:
    """sha256 of an adapter's header then trailer embeddings as stored (C order, little-endian): what
    ``recipe.tensors_sha256`` holds."""
    digest = hashlib.sha256()
    for data in (header_embeddings, trailer_embeddings):
        digest.update(data)
    return digest.hexdigest()
