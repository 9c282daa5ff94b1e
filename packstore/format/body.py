"""Pack body without tensors: stored chunks, their checksums, and a strict safetensors table reader.

A chunk's plain bytes are a safetensors blob; ``tensor_table`` validates its layout as strictly
as safetensors does and says where each tensor's bytes are. Turning those bytes into K/V
tensors is the torch side, in ``packstore.packs.tensors``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import blake3

from packstore.errors import IntegrityError, InvalidInput
from packstore.format.header import ChunkInfo, PackHeader
from packstore.format.signature import Signature

LAYERS_PER_CHUNK = 1
# Writers split a knowledge pack longer than this into token blocks of this many positions per layer, so a
# reader of a prefix fetches only the blocks holding it (about 1.5 MB per block on smollm2-135m, float32).
BLOCK_POSITIONS = 1024
ERRATUM_PREFIX = "Correction: "  # an erratum is rendered as one more line: this prefix, then its text
MAX_TABLE_BYTES = 100_000_000  # the cap safetensors itself puts on its JSON header
# safetensors dtype -> (header dtype name, element size): the dtypes a pack body may hold
SAFETENSORS_DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class EncodedPack:
    """A pack as stored: header (with chunk checksums), the chunk bytes in order, and its signatures."""

    header: PackHeader
    chunks: list[bytes]
    signatures: tuple[Signature, ...] = ()

    def check_signatures(self) -> None:
        """Raise IntegrityError unless every signature signs this pack's digest and verifies."""
        check_pack_signatures(self.header, self.signatures)

    @property
    def stored_bytes(self) -> int:
        return len(self.header.to_json()) + sum(len(c) for c in self.chunks)


def check_pack_signatures(header: PackHeader, signatures: tuple[Signature, ...]) -> None:
    """Raise IntegrityError unless every signature signs ``header``'s pack digest and verifies."""
    for signature in signatures:
        signature.check("pack", header.pack_sha256)


def chunk_tensor_names(header: PackHeader, info: ChunkInfo) -> set[str]:
    """The names a chunk must hold: the two tensors of each of its layers (K and V), nothing else."""
    return {name for layer in range(info.first_layer, info.stop_layer) for name in header.tensor_names(layer)}


MAX_CHUNK_PLAIN_BYTES = 4 << 30  # no chunk decodes to more, whatever its header declares
_TABLE_BYTES_PER_TENSOR = 1024  # room for one tensor's entry in a chunk's safetensors table


def max_plain_bytes(info: ChunkInfo) -> int:
    """The most a chunk may decode to: its declared K/V bytes plus a safetensors table for its
    tensors, and never more than ``MAX_CHUNK_PLAIN_BYTES``. Decompression stops there."""
    table = 8 + 4096 + _TABLE_BYTES_PER_TENSOR * 2 * (info.stop_layer - info.first_layer)
    return min(info.raw_bytes + table, MAX_CHUNK_PLAIN_BYTES)


def chunks_for(header: PackHeader, layers: tuple[int, int] | None = None, prefix: int | None = None) -> tuple[int, ...]:
    """The indices of the chunks holding layers ``layers`` (first, last; inclusive; None: every layer of the body)
    for positions ``0 .. prefix-1`` (None: all): all a partial read needs. InvalidInput if either is out of range."""
    span = header.body_layers
    first, last = layers if layers is not None else (span.start, span.stop - 1)
    if not span.start <= first <= last < span.stop:
        raise InvalidInput(f"pack {header.key}: layers {first}-{last} are not within its layers {span.start}-{span.stop - 1}")
    if prefix is not None:
        if header.kind != "knowledge":
            raise InvalidInput(f"pack {header.key}: a {header.kind} pack has no token positions to read a prefix of")
        if not 1 <= prefix <= header.positions:
            raise InvalidInput(f"pack {header.key}: a prefix of {prefix} positions is not within its 1-{header.positions}")
    return tuple(
        index
        for index, chunk in enumerate(header.chunks)
        if chunk.first_layer <= last
        and chunk.stop_layer > first
        and (prefix is None or chunk.positions_held(header.positions).start < prefix)
    )


def describe_chunk(info: ChunkInfo) -> str:
    """The layers (and a token block's positions) a chunk holds, for messages."""
    held = f"layers {info.first_layer}-{info.stop_layer - 1}"
    return held if info.stop_position is None else f"{held}, positions {info.first_position}-{info.stop_position - 1}"


def chunk_digest(data: bytes | bytearray | memoryview, algorithm: str) -> str:
    """The hex digest of a chunk's stored bytes by ``algorithm`` ("sha256" up to version 3, "blake3" after)."""
    if algorithm == "blake3":
        return blake3.blake3(data).hexdigest()  # releases the GIL, so chunks hash in parallel threads
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise IntegrityError(f"unknown chunk digest {algorithm!r}")


def verify_chunk(header: PackHeader, index: int, data: bytes | bytearray | memoryview) -> None:
    """Raise IntegrityError if chunk ``index`` does not match its size and digest."""
    verify_chunk_info(header.key, index, header.chunks[index], data)


def verify_chunk_info(key: str, index: int, info: ChunkInfo, data: bytes | bytearray | memoryview) -> None:
    """Raise IntegrityError if chunk ``index`` of pack ``key`` does not match the size and digest of its record ``info``
    (before the header listing it is made: a pack written as it is encoded)."""
    if len(data) != info.stored_bytes or chunk_digest(data, info.algorithm) != info.digest:
        raise IntegrityError(
            f"pack {key}: chunk {index} ({describe_chunk(info)}) is damaged: checksum mismatch"
        )


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors blob: its header dtype name, shape and bytes ``blob[start:stop]``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object hook: a name given twice would hide one of its entries."""
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise IntegrityError(f"safetensors header names {name!r} twice (names must be unique)")
        seen[name] = value
    return seen


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _byte_length(shape: list[int], itemsize: int, cap: int) -> int:
    """``prod(shape) * itemsize``, or any number above ``cap`` once it exceeds it (a hostile shape stays cheap)."""
    if 0 in shape:
        return 0
    length = itemsize
    for dim in shape:
        if length > cap:
            break
        length *= dim
    return length


def _read_entry(name: str, entry: Any, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """Check one tensor's table entry on its own; returns (dtype name, shape, start, stop) in the data section."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise IntegrityError(f"tensor {name!r}: entry must be an object with exactly dtype, shape and data_offsets")
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise IntegrityError(f"tensor {name!r}: unknown dtype {entry['dtype']!r} (known: {', '.join(SAFETENSORS_DTYPES)})")
    dtype, itemsize = SAFETENSORS_DTYPES[entry["dtype"]]
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise IntegrityError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets) or offsets[0] > offsets[1]:
        raise IntegrityError(f"tensor {name!r}: data_offsets {offsets!r} are not [start, stop] integers with 0 <= start <= stop")
    start, stop = offsets
    if stop > data_len:
        raise IntegrityError(f"tensor {name!r}: data_offsets [{start}, {stop}] run past the {data_len}-byte data section")
    needed = _byte_length(shape, itemsize, data_len)
    if needed > data_len:
        raise IntegrityError(f"tensor {name!r}: its shape of {entry['dtype']} needs more than the {data_len}-byte data section")
    if stop - start != needed:
        raise IntegrityError(f"tensor {name!r}: holds {stop - start} bytes, but shape {shape} of {entry['dtype']} needs {needed}")
    return dtype, tuple(shape), start, stop


def tensor_table(blob: bytes | bytearray | memoryview) -> list[TensorEntry]:
    """The tensors of a safetensors blob, in data order, after checking its layout strictly.

    Refused with IntegrityError (naming the tensor and the rule): a header size beyond
    ``MAX_TABLE_BYTES`` or the buffer, a table that is not a JSON object of tensor entries (plus an
    optional ``__metadata__`` of strings), an unknown dtype, a shape that is not non-negative
    integers, a byte length other than ``prod(shape) * itemsize``, and data offsets that are not
    contiguous from 0 to the end of the buffer (a gap, an overlap, two tensors sharing bytes,
    trailing bytes). Only the table is copied; the byte ranges index ``blob`` itself.
    """
    if len(blob) < 8:
        raise IntegrityError(f"safetensors blob of {len(blob)} bytes is shorter than its 8-byte header size")
    (table_len,) = struct.unpack_from("<Q", blob)
    if table_len > MAX_TABLE_BYTES:
        raise IntegrityError(f"safetensors header size {table_len} exceeds the {MAX_TABLE_BYTES}-byte limit")
    if 8 + table_len > len(blob):
        raise IntegrityError(f"safetensors header size {table_len} runs past the end of the {len(blob)}-byte blob")
    data_start = 8 + table_len
    entries = data_table(blob[:data_start], len(blob) - data_start)
    return [TensorEntry(e.name, e.dtype, e.shape, data_start + e.start, data_start + e.stop) for e in entries]


def data_table(head: bytes | bytearray | memoryview, data_len: int) -> tuple[TensorEntry, ...]:
    """``tensor_table`` of a blob given as its header (size field and JSON table, exactly) and the length of
    the data section that follows, with byte ranges relative to that section: for decoding the data
    straight into place without the blob ever being put together. Small tables are parsed once per distinct
    bytes (a pack's chunks repeat theirs from fetch to fetch, and packs of one model share them)."""
    if len(head) <= REMEMBERED_TABLE_BYTES:
        return _remembered_table(bytes(head), data_len)
    return _parse_table(head, data_len)


REMEMBERED_TABLE_BYTES = 4096
REMEMBERED_TABLES = 4096  # about 1 MB at most; a chunk of one layer's K and V has a table of about 200 bytes


@functools.lru_cache(maxsize=REMEMBERED_TABLES)
def _remembered_table(head: bytes, data_len: int) -> tuple[TensorEntry, ...]:
    return _parse_table(head, data_len)  # a table refused raises: lru_cache remembers only results


def _parse_table(head: bytes | bytearray | memoryview, data_len: int) -> tuple[TensorEntry, ...]:
    if len(head) < 8 or 8 + struct.unpack_from("<Q", head)[0] != len(head):
        raise IntegrityError(f"safetensors header of {len(head)} bytes does not match its size field")
    if len(head) - 8 > MAX_TABLE_BYTES:
        raise IntegrityError(f"safetensors header size {len(head) - 8} exceeds the {MAX_TABLE_BYTES}-byte limit")
    try:
        table = json.loads(bytes(head[8:]).decode("utf-8"), object_pairs_hook=_refuse_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise IntegrityError(f"safetensors header is not valid JSON: {exc}") from None
    if not isinstance(table, dict):
        raise IntegrityError(f"safetensors header is a JSON {type(table).__name__}, not an object of tensor entries")
    metadata = table.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise IntegrityError("safetensors __metadata__ must be an object of strings")

    entries = sorted(
        (TensorEntry(name, *_read_entry(name, entry, data_len)) for name, entry in table.items()),
        key=lambda e: (e.start, e.stop),
    )
    end, previous = 0, None
    for entry in entries:
        if entry.start > end:
            where = f"after tensor {previous.name!r}" if previous else "at the start of the data section"
            raise IntegrityError(f"tensor {entry.name!r}: {entry.start - end} unused bytes {where} (tensors must be contiguous from 0)")
        if entry.start < end:
            assert previous is not None  # end > 0 only once a tensor was read
            if (entry.start, entry.stop) == (previous.start, previous.stop):
                raise IntegrityError(f"tensor {entry.name!r}: aliases the bytes of tensor {previous.name!r} (tensors must not share bytes)")
            raise IntegrityError(f"tensor {entry.name!r}: overlaps tensor {previous.name!r} (tensors must not share bytes)")
        end, previous = entry.stop, entry
    if end != data_len:
        after = f"after tensor {previous.name!r}" if previous else "and no tensors"
        raise IntegrityError(f"safetensors data section has {data_len - end} trailing bytes {after} (tensors must cover it exactly)")
    return tuple(entries)
