"""The torch side of the format: chunk bytes <-> K/V tensors.

``packstore.format`` holds everything about a pack's bytes that needs no torch (header, codec,
chunk checksums, the strict safetensors table); this module builds tensors on top of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import torch
from safetensors.torch import save as safetensors_save

from packstore.errors import IntegrityError, InvalidInput
from packstore.format import codec
from packstore.format.body import (
    BLOCK_POSITIONS,
    LAYERS_PER_CHUNK,
    EncodedPack,
    chunk_tensor_names,
    describe_chunk,
    max_plain_bytes,
    tensor_table,
    verify_chunk,
)
from packstore.format.header import CODEC, ChunkInfo, PackHeader

# zstd releases the GIL, so chunks are coded in parallel threads.
WORKERS = max(1, min(8, os.cpu_count() or 1))
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


@dataclass
class Pack:
    """A pack in memory: header plus K and V for each layer of ``header.body_layers`` (every layer of
    a knowledge pack, each ``[kv_heads, tokens, head_dim]``; a steering pack's deltas, each ``[kv_heads, head_dim]``)."""

    header: PackHeader
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def to(self, device: torch.device | str) -> "Pack":
        """The same pack with its tensors on ``device`` (no copy where they already are)."""
        return Pack(header=self.header, keys=[k.to(device) for k in self.keys], values=[v.to(device) for v in self.values])

    def check_shapes(self) -> None:
        """Raise InvalidInput unless every tensor matches the header's shape and dtype."""
        check_shapes(self.header, self.header.body_layers, self.keys, self.values)


def check_shapes(
    header: PackHeader, layers: range, keys: list[torch.Tensor], values: list[torch.Tensor], *, positions: int | None = None
) -> None:
    """Raise InvalidInput unless ``keys`` and ``values`` hold one tensor of the header's shape and dtype per layer
    of ``layers`` (of its first ``positions`` positions, when given)."""
    expected = header.tensor_shape if positions is None else (header.kv_heads, positions, header.head_dim)
    if len(keys) != len(layers) or len(values) != len(layers):
        raise InvalidInput(f"pack has {len(keys)} K / {len(values)} V layers, header says {len(layers)}")
    for i, k, v in zip(layers, keys, values):
        for name, t in (("K", k), ("V", v)):
            if tuple(t.shape) != expected or t.dtype != torch_dtype(header.dtype):
                raise InvalidInput(f"layer {i} {name} is {tuple(t.shape)} {t.dtype}, header says {expected} {header.dtype}")


@dataclass
class PackPart:
    """Part of a pack's body, read without the rest (``PackStore.fetch_part``): K and V of each of ``layers``
    for its first ``positions`` positions (each ``[kv_heads, positions, head_dim]``; a steering pack's or an
    adapter's tensors whole)."""

    header: PackHeader
    layers: range
    positions: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def adapter_tensors_sha256(header: torch.Tensor, trailer: torch.Tensor) -> str:
    """sha256 of an adapter's header then trailer embeddings, as stored (C order, little-endian)."""
    digest = hashlib.sha256()
    for tensor in (header, trailer):
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_tensor_digest(pack: Pack) -> None:
    """An adapter's key covers its tensors through ``recipe.tensors_sha256``: IntegrityError unless they match."""
    if pack.header.kind == "adapter" and adapter_tensors_sha256(pack.keys[0], pack.values[0]) != pack.header.recipe["tensors_sha256"]:
        raise IntegrityError(f"pack {pack.header.key}: the adapter's tensors do not match recipe.tensors_sha256")


def _encode_chunk(pack: Pack, first: int, stop: int, block: range | None) -> tuple[bytes, ChunkInfo]:
    """Code layers ``first`` to ``stop - 1`` (only the positions of ``block`` when given) as one chunk."""
    tensors = {}
    offset = pack.header.body_layers.start  # keys[i] holds body layer offset + i
    for layer in range(first, stop):
        k_name, v_name = pack.header.tensor_names(layer)
        key, value = pack.keys[layer - offset], pack.values[layer - offset]
        if block is not None:
            key, value = key[:, block.start : block.stop], value[:, block.start : block.stop]
        tensors[k_name], tensors[v_name] = key.contiguous(), value.contiguous()
    stored = codec.encode(safetensors_save(tensors), pack.keys[0].element_size())
    info = ChunkInfo(
        first_layer=first,
        stop_layer=stop,
        raw_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        stored_bytes=len(stored),
        sha256=hashlib.sha256(stored).hexdigest(),
        first_position=None if block is None else block.start,
        stop_position=None if block is None else block.stop,
    )
    return stored, info


def encode_pack(pack: Pack, *, block_positions: int = BLOCK_POSITIONS) -> EncodedPack:
    """Serialize each run of ``LAYERS_PER_CHUNK`` layers as safetensors, compress and checksum it.

    A knowledge pack of more than ``block_positions`` positions is split further into token blocks of that
    many positions per layer run, so that a prefix can be read alone. A steering pack's deltas (a few KB)
    go in one chunk."""
    pack.check_shapes()
    header, layers = pack.header, pack.header.body_layers
    per_chunk = LAYERS_PER_CHUNK if header.kind == "knowledge" else len(layers)
    blocked = header.kind == "knowledge" and header.positions > block_positions
    blocks = [range(p, min(p + block_positions, header.positions)) for p in range(0, header.positions, block_positions)] if blocked else [None]
    plan = [(first, min(first + per_chunk, layers.stop), block) for first in range(layers.start, layers.stop, per_chunk) for block in blocks]
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda chunk: _encode_chunk(pack, *chunk), plan))
    header = dataclasses.replace(header, codec=CODEC, chunks=tuple(info for _, info in results))
    return EncodedPack(header=header, chunks=[stored for stored, _ in results])


def tensors_in(blob: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob as views of it (no copy); raises IntegrityError if its layout is not strict."""
    tensors = {}
    for entry in tensor_table(blob):
        dtype = torch_dtype(entry.dtype)
        count = (entry.stop - entry.start) // dtype.itemsize
        flat = torch.frombuffer(blob, dtype=dtype, count=count, offset=entry.start) if count else torch.empty(0, dtype=dtype)
        tensors[entry.name] = flat.reshape(entry.shape)
    return tensors


def decode_chunk(header: PackHeader, index: int, data: bytes) -> dict[str, torch.Tensor]:
    """Verify one chunk's checksum, then decode it to its named tensors (views of one decoded buffer)."""
    verify_chunk(header, index, data)
    info = header.chunks[index]
    try:
        tensors = tensors_in(codec.decode(data, max_plain_bytes(info)))
    except IntegrityError as exc:
        raise IntegrityError(f"pack {header.key}: chunk {index} cannot be decoded: {exc}") from None
    if set(tensors) != chunk_tensor_names(header, info):
        raise IntegrityError(f"pack {header.key}: chunk {index} does not hold exactly the tensors of {describe_chunk(info)}")
    return tensors


class BodyAssembler:
    """Puts decoded chunks together into K and V per layer of ``layers`` for positions ``0 .. positions-1``
    (all when None) on ``device``. On CPU a chunk that holds a layer whole stays a view of its decoded buffer
    (no copy); token blocks, and chunks bound for another device, are copied into one tensor per layer.
    ``place`` may be called from several threads, one chunk each."""

    def __init__(self, header: PackHeader, layers: range, positions: int | None, device: object = None) -> None:
        self.header, self.layers, self.device = header, layers, torch.device(device or "cpu")
        blocked = any(chunk.stop_position is not None for chunk in header.chunks)
        self.positions = header.positions if positions is None and header.kind == "knowledge" else positions
        self._copy = blocked or self.device.type != "cpu"
        shape = header.tensor_shape if self.positions is None else (header.kv_heads, self.positions, header.head_dim)
        dtype = torch_dtype(header.dtype)
        count = len(layers)
        self.keys: list = [torch.empty(shape, dtype=dtype, device=self.device) if self._copy else None for _ in range(count)]
        self.values: list = [torch.empty(shape, dtype=dtype, device=self.device) if self._copy else None for _ in range(count)]
        self._slots = {}  # tensor name -> (list, slot)
        for slot, layer in enumerate(layers):
            k_name, v_name = header.tensor_names(layer)
            self._slots[k_name], self._slots[v_name] = (self.keys, slot), (self.values, slot)
        self._covered = [0] * count
        self._lock = threading.Lock()

    def place(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put the tensors of chunk ``index`` (from ``decode_chunk``) in their places; those of other layers are dropped."""
        held = self.header.chunks[index].positions_held(self.header.positions)
        stop = held.stop if self.positions is None else min(held.stop, self.positions)
        if self.positions is not None and stop <= held.start:
            return  # a block past the positions wanted holds nothing of them
        for name, tensor in tensors.items():
            if name not in self._slots:
                continue
            target, slot = self._slots[name]
            if self.positions is not None:
                tensor = tensor[:, : stop - held.start]  # a view: the positions wanted of this chunk's
            if not self._copy:
                target[slot] = tensor
            elif self.positions is None:
                target[slot].copy_(self._staged(tensor), non_blocking=True)
            else:
                target[slot][:, held.start : stop].copy_(self._staged(tensor), non_blocking=True)
            if target is self.keys:
                with self._lock:
                    self._covered[slot] += 1 if self.positions is None else stop - held.start

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU tensor ready to copy to the device: pinned for CUDA, so the copy does not block."""
        return tensor.pin_memory() if self.device.type == "cuda" else tensor

    def finish(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V per layer; IntegrityError if the chunks placed did not cover every layer and position once."""
        whole = 1 if self.positions is None else self.positions
        for slot, covered in enumerate(self._covered):
            if covered != whole:
                raise IntegrityError(f"pack {self.header.key}: the chunks read hold {covered} of the {whole} positions of layer {self.layers[slot]}")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self.keys, self.values


def decode_part(
    header: PackHeader, layers: tuple[int, int] | None, prefix: int | None, chunks: Iterable[tuple[int, bytes]], device: object = None
) -> PackPart:
    """Verify and decode the chunks ``chunks_for(header, layers, prefix)`` as (index, bytes), in parallel, into
    layers ``layers`` (first, last; None: all) for the first ``prefix`` positions (None: all) on ``device``."""
    if header.codec != CODEC:
        raise IntegrityError(f"pack {header.key}: unknown codec {header.codec!r}")
    span = header.body_layers if layers is None else range(layers[0], layers[1] + 1)
    assembler = BodyAssembler(header, span, prefix, device)
    with ThreadPoolExecutor(WORKERS) as pool:
        for future in [pool.submit(lambda item: assembler.place(item[0], decode_chunk(header, *item)), item) for item in chunks]:
            future.result()
    keys, values = assembler.finish()
    try:
        check_shapes(header, span, keys, values, positions=prefix)
    except InvalidInput as exc:
        raise IntegrityError(f"pack {header.key}: {exc}") from None
    return PackPart(header, span, header.positions if prefix is None else prefix, keys, values)


def pack_from_chunks(header: PackHeader, chunks: Iterable[tuple[int, bytes]], device: object = None) -> Pack:
    """A whole pack from every chunk as (index, bytes), each verified and decoded (in parallel, as they come) on ``device``."""
    part = decode_part(header, None, None, chunks, device)
    pack = Pack(header=header, keys=part.keys, values=part.values)
    check_tensor_digest(pack)
    return pack


def decode_pack(encoded: EncodedPack, device: object = None) -> Pack:
    """Verify every chunk's checksum, then decode the chunks (in parallel) into per-layer tensors on ``device``."""
    header = encoded.header
    if len(encoded.chunks) != len(header.chunks):
        raise IntegrityError(f"pack {header.key}: has {len(encoded.chunks)} chunks, header lists {len(header.chunks)}")
    return pack_from_chunks(header, enumerate(encoded.chunks), device)
