"""Pack body: per-layer K/V tensors <-> checksummed, compressed safetensors chunks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors.torch import save as safetensors_save

from packstore.errors import IntegrityError, InvalidInput
from packstore.format import codec
from packstore.format.header import ChunkInfo, PackHeader

CODEC = "byteplane-zstd"
LAYERS_PER_CHUNK = 1
# zstd releases the GIL, so chunks are coded in parallel threads.
_WORKERS = max(1, min(8, os.cpu_count() or 1))
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


@dataclass
class Pack:
    """A pack in memory: header plus per-layer K and V, each ``[kv_heads, tokens, head_dim]`` on CPU."""

    header: PackHeader
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def check_shapes(self) -> None:
        """Raise InvalidInput unless every tensor matches the header's shape and dtype."""
        h = self.header
        expected = (h.kv_heads, h.tokens, h.head_dim)
        if len(self.keys) != h.layers or len(self.values) != h.layers:
            raise InvalidInput(f"pack has {len(self.keys)} K / {len(self.values)} V layers, header says {h.layers}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for name, t in (("K", k), ("V", v)):
                if tuple(t.shape) != expected or t.dtype != torch_dtype(h.dtype):
                    raise InvalidInput(
                        f"layer {i} {name} is {tuple(t.shape)} {t.dtype}, header says {expected} {h.dtype}"
                    )


@dataclass(frozen=True)
class EncodedPack:
    """A pack as stored: header (with chunk checksums) and the chunk bytes, in order."""

    header: PackHeader
    chunks: list[bytes]

    @property
    def stored_bytes(self) -> int:
        return len(self.header.to_json()) + sum(len(c) for c in self.chunks)


def _layer_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.key", f"layers.{layer}.value"


def _encode_chunk(pack: Pack, first: int, stop: int) -> tuple[bytes, ChunkInfo]:
    tensors = {}
    for layer in range(first, stop):
        k_name, v_name = _layer_names(layer)
        tensors[k_name] = pack.keys[layer].contiguous()
        tensors[v_name] = pack.values[layer].contiguous()
    stored = codec.encode(safetensors_save(tensors), pack.keys[first].element_size())
    info = ChunkInfo(
        first_layer=first,
        stop_layer=stop,
        raw_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        stored_bytes=len(stored),
        sha256=hashlib.sha256(stored).hexdigest(),
    )
    return stored, info


def encode_pack(pack: Pack) -> EncodedPack:
    """Serialize each run of ``LAYERS_PER_CHUNK`` layers as safetensors, compress and checksum it."""
    pack.check_shapes()
    runs = [(first, min(first + LAYERS_PER_CHUNK, pack.header.layers)) for first in range(0, pack.header.layers, LAYERS_PER_CHUNK)]
    with ThreadPoolExecutor(_WORKERS) as pool:
        results = list(pool.map(lambda run: _encode_chunk(pack, *run), runs))
    header = dataclasses.replace(pack.header, codec=CODEC, chunks=tuple(info for _, info in results))
    return EncodedPack(header=header, chunks=[stored for stored, _ in results])


def verify_chunk(header: PackHeader, index: int, data: bytes) -> None:
    """Raise IntegrityError if chunk ``index`` does not match its size and sha256."""
    info = header.chunks[index]
    if len(data) != info.stored_bytes or hashlib.sha256(data).hexdigest() != info.sha256:
        raise IntegrityError(
            f"pack {header.key}: chunk {index} (layers {info.first_layer}-{info.stop_layer - 1}) is damaged: checksum mismatch"
        )


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def tensors_in(blob: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob as views of it (no copy); raises IntegrityError if malformed."""
    try:
        size = struct.unpack_from("<Q", blob)[0]
        table = json.loads(bytes(blob[8 : 8 + size]))
        tensors = {}
        for name, entry in table.items():
            if name == "__metadata__":
                continue
            start, stop = entry["data_offsets"]
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            count = (stop - start) // dtype.itemsize
            if not 0 <= start <= stop <= len(blob) - 8 - size or count != math.prod(entry["shape"]):
                raise ValueError(f"tensor {name} does not fit its declared shape and offsets")
            flat = torch.frombuffer(blob, dtype=dtype, count=count, offset=8 + size + start) if count else torch.empty(0, dtype=dtype)
            tensors[name] = flat.reshape(entry["shape"])
        return tensors
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"malformed safetensors data: {exc}") from None


def decode_chunk(header: PackHeader, index: int, data: bytes) -> dict[str, torch.Tensor]:
    """Verify one chunk's checksum, then decode it to its named tensors (views of one decoded buffer)."""
    verify_chunk(header, index, data)
    try:
        tensors = tensors_in(codec.decode(data))
    except IntegrityError as exc:
        raise IntegrityError(f"pack {header.key}: chunk {index} cannot be decoded: {exc}") from None
    info = header.chunks[index]
    expected = {name for layer in range(info.first_layer, info.stop_layer) for name in _layer_names(layer)}
    if set(tensors) != expected:
        raise IntegrityError(f"pack {header.key}: chunk {index} does not hold exactly layers {info.first_layer}-{info.stop_layer - 1}")
    return tensors


def decode_pack(encoded: EncodedPack) -> Pack:
    """Verify every chunk's checksum, then decode the chunks (in parallel) into per-layer tensors."""
    header = encoded.header
    if header.codec != CODEC:
        raise IntegrityError(f"pack {header.key}: unknown codec {header.codec!r}")
    if len(encoded.chunks) != len(header.chunks):
        raise IntegrityError(f"pack {header.key}: has {len(encoded.chunks)} chunks, header lists {len(header.chunks)}")
    with ThreadPoolExecutor(_WORKERS) as pool:
        decoded = list(pool.map(lambda item: decode_chunk(header, *item), enumerate(encoded.chunks)))
    tensors = {name: tensor for part in decoded for name, tensor in part.items()}
    keys, values = [], []
    for layer in range(header.layers):
        k_name, v_name = _layer_names(layer)
        if k_name not in tensors:
            raise IntegrityError(f"pack {header.key}: no chunk holds layer {layer}")
        keys.append(tensors[k_name])
        values.append(tensors[v_name])
    pack = Pack(header=header, keys=keys, values=values)
    try:
        pack.check_shapes()
    except InvalidInput as exc:
        raise IntegrityError(f"pack {header.key}: {exc}") from None
    return pack
