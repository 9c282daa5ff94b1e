"""Pack body: per-layer K/V tensors <-> checksummed, compressed safetensors chunks."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from packstore.errors import IntegrityError, InvalidInput
from packstore.format.header import ChunkInfo, PackHeader

CODEC = "zstd"
ZSTD_LEVEL = 3
LAYERS_PER_CHUNK = 1
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


def encode_pack(pack: Pack) -> EncodedPack:
    """Serialize each run of ``LAYERS_PER_CHUNK`` layers as safetensors, compress, checksum."""
    pack.check_shapes()
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    chunks: list[bytes] = []
    infos: list[ChunkInfo] = []
    for first in range(0, pack.header.layers, LAYERS_PER_CHUNK):
        stop = min(first + LAYERS_PER_CHUNK, pack.header.layers)
        tensors = {}
        for layer in range(first, stop):
            k_name, v_name = _layer_names(layer)
            tensors[k_name] = pack.keys[layer].contiguous()
            tensors[v_name] = pack.values[layer].contiguous()
        plain = safetensors_save(tensors)
        stored = compressor.compress(plain)
        chunks.append(stored)
        infos.append(
            ChunkInfo(
                first_layer=first,
                stop_layer=stop,
                raw_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                stored_bytes=len(stored),
                sha256=hashlib.sha256(stored).hexdigest(),
            )
        )
    header = dataclasses.replace(pack.header, codec=CODEC, chunks=tuple(infos))
    return EncodedPack(header=header, chunks=chunks)


def verify_chunk(header: PackHeader, index: int, data: bytes) -> None:
    """Raise IntegrityError if chunk ``index`` does not match its size and sha256."""
    info = header.chunks[index]
    if len(data) != info.stored_bytes or hashlib.sha256(data).hexdigest() != info.sha256:
        raise IntegrityError(f"pack {header.key}: chunk {index} (layers {info.first_layer}-{info.stop_layer - 1}) is damaged: checksum mismatch")


def decode_pack(encoded: EncodedPack) -> Pack:
    """Verify every chunk's checksum, then decompress and load its tensors."""
    header = encoded.header
    if header.codec != CODEC:
        raise IntegrityError(f"pack {header.key}: unknown codec {header.codec!r}")
    if len(encoded.chunks) != len(header.chunks):
        raise IntegrityError(f"pack {header.key}: has {len(encoded.chunks)} chunks, header lists {len(header.chunks)}")
    decompressor = zstandard.ZstdDecompressor()
    keys: list[torch.Tensor] = [None] * header.layers  # type: ignore[list-item]
    values: list[torch.Tensor] = [None] * header.layers  # type: ignore[list-item]
    for index, (info, data) in enumerate(zip(header.chunks, encoded.chunks)):
        verify_chunk(header, index, data)
        try:
            tensors = safetensors_load(decompressor.decompress(data, max_output_size=info.raw_bytes + (1 << 20)))
        except (zstandard.ZstdError, SafetensorError) as exc:
            raise IntegrityError(f"pack {header.key}: chunk {index} cannot be decoded: {exc}") from None
        for layer in range(info.first_layer, info.stop_layer):
            k_name, v_name = _layer_names(layer)
            if k_name not in tensors or v_name not in tensors:
                raise IntegrityError(f"pack {header.key}: chunk {index} lacks layer {layer}")
            keys[layer], values[layer] = tensors[k_name], tensors[v_name]
    missing = [layer for layer, k in enumerate(keys) if k is None]
    if missing:
        raise IntegrityError(f"pack {header.key}: no chunk holds layers {missing}")
    pack = Pack(header=header, keys=keys, values=values)
    try:
        pack.check_shapes()
    except InvalidInput as exc:
        raise IntegrityError(f"pack {header.key}: {exc}") from None
    return pack
