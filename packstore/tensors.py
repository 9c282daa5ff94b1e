"""The torch side of the format: chunk bytes <-> K/V tensors.

``packstore.format`` holds everything about a pack's bytes that needs no torch (header, codec,
chunk checksums, the strict safetensors table); this module builds tensors on top of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import torch
from safetensors.torch import save as safetensors_save

from packstore.errors import IntegrityError, InvalidInput
from packstore.format import codec
from packstore.format.body import (
    LAYERS_PER_CHUNK,
    EncodedPack,
    chunk_tensor_names,
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


def check_shapes(header: PackHeader, layers: range, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Raise InvalidInput unless ``keys`` and ``values`` hold one tensor of the header's shape and dtype per layer of ``layers``."""
    expected = header.tensor_shape
    if len(keys) != len(layers) or len(values) != len(layers):
        raise InvalidInput(f"pack has {len(keys)} K / {len(values)} V layers, header says {len(layers)}")
    for i, k, v in zip(layers, keys, values):
        for name, t in (("K", k), ("V", v)):
            if tuple(t.shape) != expected or t.dtype != torch_dtype(header.dtype):
                raise InvalidInput(f"layer {i} {name} is {tuple(t.shape)} {t.dtype}, header says {expected} {header.dtype}")


@dataclass
class PackLayers:
    """Some layers of a pack's body, read without the others (``PackStore.fetch_layers``): K and V of each of ``layers``."""

    header: PackHeader
    layers: range
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


def _encode_chunk(pack: Pack, first: int, stop: int) -> tuple[bytes, ChunkInfo]:
    tensors = {}
    offset = pack.header.body_layers.start  # keys[i] holds body layer offset + i
    for layer in range(first, stop):
        k_name, v_name = pack.header.tensor_names(layer)
        tensors[k_name] = pack.keys[layer - offset].contiguous()
        tensors[v_name] = pack.values[layer - offset].contiguous()
    stored = codec.encode(safetensors_save(tensors), pack.keys[0].element_size())
    info = ChunkInfo(
        first_layer=first,
        stop_layer=stop,
        raw_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        stored_bytes=len(stored),
        sha256=hashlib.sha256(stored).hexdigest(),
    )
    return stored, info


def encode_pack(pack: Pack) -> EncodedPack:
    """Serialize each run of ``LAYERS_PER_CHUNK`` layers as safetensors, compress and checksum it.

    A steering pack's deltas (a few KB) go in one chunk."""
    pack.check_shapes()
    layers = pack.header.body_layers
    per_chunk = LAYERS_PER_CHUNK if pack.header.kind == "knowledge" else len(layers)
    runs = [(first, min(first + per_chunk, layers.stop)) for first in range(layers.start, layers.stop, per_chunk)]
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda run: _encode_chunk(pack, *run), runs))
    header = dataclasses.replace(pack.header, codec=CODEC, chunks=tuple(info for _, info in results))
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
    try:
        tensors = tensors_in(codec.decode(data, max_plain_bytes(header.chunks[index])))
    except IntegrityError as exc:
        raise IntegrityError(f"pack {header.key}: chunk {index} cannot be decoded: {exc}") from None
    info = header.chunks[index]
    if set(tensors) != chunk_tensor_names(header, info):
        raise IntegrityError(f"pack {header.key}: chunk {index} does not hold exactly layers {info.first_layer}-{info.stop_layer - 1}")
    return tensors


def decode_layers(header: PackHeader, first: int, last: int, chunks: Iterable[tuple[int, bytes]], device: object = None) -> PackLayers:
    """Verify and decode the chunks ``chunks_for_layers(header, first, last)`` as (index, bytes), in parallel,
    keeping layers ``first`` to ``last`` on ``device`` (CPU when None); IntegrityError if one is missing."""
    with ThreadPoolExecutor(WORKERS) as pool:
        decoded = list(pool.map(lambda item: decode_chunk(header, *item), chunks))
    tensors = {name: tensor for part in decoded for name, tensor in part.items()}
    layers = range(first, last + 1)
    names = [header.tensor_names(layer) for layer in layers]
    missing = [layer for layer, (k_name, _) in zip(layers, names) if k_name not in tensors]
    if missing:
        raise IntegrityError(f"pack {header.key}: no chunk read holds layer {missing[0]}")
    keys, values = [tensors[k_name] for k_name, _ in names], [tensors[v_name] for _, v_name in names]
    try:
        check_shapes(header, layers, keys, values)
    except InvalidInput as exc:
        raise IntegrityError(f"pack {header.key}: {exc}") from None
    device = device or "cpu"
    return PackLayers(header, layers, [k.to(device) for k in keys], [v.to(device) for v in values])


def decode_pack(encoded: EncodedPack) -> Pack:
    """Verify every chunk's checksum, then decode the chunks (in parallel) into per-layer tensors."""
    header = encoded.header
    if header.codec != CODEC:
        raise IntegrityError(f"pack {header.key}: unknown codec {header.codec!r}")
    if len(encoded.chunks) != len(header.chunks):
        raise IntegrityError(f"pack {header.key}: has {len(encoded.chunks)} chunks, header lists {len(header.chunks)}")
    with ThreadPoolExecutor(WORKERS) as pool:
        decoded = list(pool.map(lambda item: decode_chunk(header, *item), enumerate(encoded.chunks)))
    tensors = {name: tensor for part in decoded for name, tensor in part.items()}
    keys, values = [], []
    for layer in header.body_layers:
        k_name, v_name = header.tensor_names(layer)
        if k_name not in tensors:
            raise IntegrityError(f"pack {header.key}: no chunk holds layer {layer}")
        keys.append(tensors[k_name])
        values.append(tensors[v_name])
    pack = Pack(header=header, keys=keys, values=values)
    try:
        pack.check_shapes()
    except InvalidInput as exc:
        raise IntegrityError(f"pack {header.key}: {exc}") from None
    check_tensor_digest(pack)
    return pack
