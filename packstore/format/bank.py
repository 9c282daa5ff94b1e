"""Bank records: metadata JSON, centroid matrix, one blob per cluster (fp16 embeddings + texts), lexical index.

Each binary record ends with the sha256 of what precedes it, so damage is detected on read.
See docs/format.md §6.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import zstandard

from packstore.errors import IntegrityError
from packstore.format.header import canonical_json

BANK_FORMAT = "packstore-bank"
BANK_VERSION = 1
CLUSTER_MAGIC = b"PSBK"
QUANTIZED_CLUSTER_MAGIC = b"PSBQ"
CENTROIDS_MAGIC = b"PSBC"
LEXICAL_MAGIC = b"PSBL"
_MEMBER = struct.Struct("<HQ")  # name length, data length
_PREAMBLE = struct.Struct("<4sBII")  # magic, version, count, dim


@dataclass(frozen=True)
class BankMeta:
    """A bank's description: its embedder's identity, sizes, and the next fact id to hand out."""

    name: str
    embedder: str
    embedder_fp: str
    dim: int
    facts: int
    clusters: int
    next_fact_id: int
    created: str
    updated: str
    lexical: str = ""  # the full-text index's kind (e.g. "bm25s/en/snowball"); "" for a bank without one
    vectors: str = "fp16"  # how fact embeddings are stored: "fp16" or "int8" (VECTOR_KINDS)

    def to_json(self) -> bytes:
        return canonical_json(asdict(self) | {"format": BANK_FORMAT, "version": BANK_VERSION})

    @classmethod
    def from_json(cls, data: bytes) -> BankMeta:
        try:
            record = json.loads(data)
            if record.pop("format") != BANK_FORMAT or record.pop("version") != BANK_VERSION:
                raise ValueError("not a bank record of a known version")
            return cls(**record)
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"bank metadata is damaged: {exc}") from None


def _seal(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _unseal(data: bytes, magic: bytes, what: str) -> tuple[memoryview, int, int]:
    view = memoryview(data)
    if len(view) < _PREAMBLE.size + 32 or hashlib.sha256(view[:-32]).digest() != bytes(view[-32:]):
        raise IntegrityError(f"{what} is damaged: checksum mismatch")
    found, version, count, dim = _PREAMBLE.unpack_from(view)
    if found != magic or version != BANK_VERSION:
        raise IntegrityError(f"{what} is not a bank record of a known version")
    return view[_PREAMBLE.size : -32], count, dim


def encode_centroids(centroids: np.ndarray) -> bytes:
    matrix = np.ascontiguousarray(centroids, dtype="<f4")
    return _seal(_PREAMBLE.pack(CENTROIDS_MAGIC, BANK_VERSION, matrix.shape[0], matrix.shape[1]) + matrix.tobytes())


def decode_centroids(data: bytes) -> np.ndarray:
    body, count, dim = _unseal(data, CENTROIDS_MAGIC, "bank centroids")
    if len(body) != count * dim * 4:
        raise IntegrityError("bank centroids have the wrong size")
    return np.frombuffer(body, dtype="<f4").reshape(count, dim)


VECTOR_KINDS = ("fp16", "int8")
# int8 unless asked otherwise: top-1 / top-5 within one question of fp16 on every data set measured, for about 380
# bytes a fact less (docs/evaluation.md); a bank's meta without the field was built before it and is fp16.
DEFAULT_VECTORS = "int8"


def quantize(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per vector: ``(codes [n, dim] int8, scales [n] float16)``, vector ~= codes x scale."""
    peaks = np.maximum(np.abs(vectors).max(axis=1), 1e-12).astype(np.float32)
    codes = np.clip(np.rint(vectors / peaks[:, None] * 127), -127, 127).astype(np.int8)
    return codes, (peaks / 127).astype(np.float16)


@dataclass
class Cluster:
    """The facts of one cluster: ids, unit embeddings and texts, in the same order.

    Embeddings are float16, or int8 codes with one float16 scale per fact (``scales``) in a bank
    built with int8 vectors: half the bytes, for a small loss of ranking precision.
    """

    ids: np.ndarray  # uint32 [n]
    embeddings: np.ndarray  # float16 [n, dim], or int8 [n, dim] with scales
    texts: list[str]
    scales: np.ndarray | None = None  # float16 [n] with int8 embeddings

    def vectors(self) -> np.ndarray:
        """float32 ``[n, dim]`` embeddings, dequantized when stored as int8."""
        if self.scales is None:
            return self.embeddings.astype(np.float32)
        return self.embeddings.astype(np.float32) * self.scales.astype(np.float32)[:, None]

    def take(self, rows: Sequence[int] | np.ndarray) -> Cluster:
        """The given rows, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        scales = None if self.scales is None else self.scales[rows]
        return Cluster(self.ids[rows], self.embeddings[rows], [self.texts[i] for i in rows], scales)

    @staticmethod
    def joined(parts: Sequence[Cluster]) -> Cluster:
        """One cluster of ``parts`` in order (all stored the same way)."""
        scales = None if parts[0].scales is None else np.concatenate([p.scales for p in parts])
        return Cluster(
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.embeddings for p in parts]),
            [t for p in parts for t in p.texts],
            scales,
        )


def encode_cluster(cluster: Cluster) -> bytes:
    """A cluster record: "PSBK" with float16 embeddings, "PSBQ" with int8 codes and their scales."""
    n, dim = cluster.embeddings.shape
    encoded = [t.encode("utf-8") for t in cluster.texts]
    if cluster.scales is None:
        magic, vectors = CLUSTER_MAGIC, [np.ascontiguousarray(cluster.embeddings, dtype="<f2").tobytes()]
    else:
        magic = QUANTIZED_CLUSTER_MAGIC
        vectors = [
            np.ascontiguousarray(cluster.embeddings, dtype="i1").tobytes(),
            np.ascontiguousarray(cluster.scales, dtype="<f2").tobytes(),
        ]
    parts = [
        _PREAMBLE.pack(magic, BANK_VERSION, n, dim),
        np.ascontiguousarray(cluster.ids, dtype="<u4").tobytes(),
        *vectors,
        np.array([len(t) for t in encoded], dtype="<u4").tobytes(),
        b"".join(encoded),
    ]
    return _seal(b"".join(parts))


def decode_cluster(data: bytes) -> Cluster:
    quantized = bytes(data[:4]) == QUANTIZED_CLUSTER_MAGIC
    body, n, dim = _unseal(data, QUANTIZED_CLUSTER_MAGIC if quantized else CLUSTER_MAGIC, "bank cluster")
    try:
        ids = np.frombuffer(body, dtype="<u4", count=n)
        offset, scales = 4 * n, None
        if quantized:
            embeddings = np.frombuffer(body, dtype="i1", count=n * dim, offset=offset).reshape(n, dim)
            offset += n * dim
            scales = np.frombuffer(body, dtype="<f2", count=n, offset=offset)
            offset += 2 * n
        else:
            embeddings = np.frombuffer(body, dtype="<f2", count=n * dim, offset=offset).reshape(n, dim)
            offset += 2 * n * dim
        lengths = np.frombuffer(body, dtype="<u4", count=n, offset=offset)
        offset += 4 * n
        raw = bytes(body[offset:])
        if int(lengths.sum()) != len(raw):
            raise ValueError("text lengths do not match")
        texts, start = [], 0
        for length in lengths.tolist():
            texts.append(raw[start : start + length].decode("utf-8"))
            start += length
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"bank cluster is damaged: {exc}") from None
    return Cluster(ids=ids, embeddings=embeddings, texts=texts, scales=scales)


def encode_lexical(cluster_starts: np.ndarray, members: dict[str, bytes]) -> bytes:
    """The lexical index record: where each cluster's facts start in document order, then named files.

    Documents are the bank's facts in cluster order (cluster 0's rows, then cluster 1's, ...), so
    fact ``row`` of cluster ``c`` is document ``cluster_starts[c] + row``; ``members`` are the
    search library's own files, zstd-compressed together (about 4x: its vocabulary is JSON).
    See docs/format.md §6.
    """
    starts = np.ascontiguousarray(cluster_starts, dtype="<u4")
    plain = []
    for name, data in sorted(members.items()):
        encoded = name.encode("utf-8")
        plain += [_MEMBER.pack(len(encoded), len(data)), encoded, data]
    joined = b"".join(plain)
    packed = zstandard.ZstdCompressor(level=3).compress(joined)
    preamble = _PREAMBLE.pack(LEXICAL_MAGIC, BANK_VERSION, len(starts), len(members))
    return _seal(preamble + starts.tobytes() + struct.pack("<Q", len(joined)) + packed)


def decode_lexical(data: bytes) -> tuple[np.ndarray, dict[str, bytes]]:
    """``(cluster_starts, members)`` of a lexical index record; IntegrityError if it is damaged."""
    body, count, member_count = _unseal(data, LEXICAL_MAGIC, "bank lexical index")
    try:
        starts = np.frombuffer(body, dtype="<u4", count=count)
        (plain_size,) = struct.unpack_from("<Q", body, 4 * count)
        plain = zstandard.ZstdDecompressor().decompress(bytes(body[4 * count + 8 :]), max_output_size=plain_size)
        if len(plain) != plain_size:
            raise ValueError("the members have the wrong size")
        offset, members = 0, {}
        for _ in range(member_count):
            name_length, length = _MEMBER.unpack_from(plain, offset)
            offset += _MEMBER.size
            name = plain[offset : offset + name_length].decode("utf-8")
            offset += name_length
            if offset + length > len(plain):
                raise ValueError(f"member {name!r} runs past the record")
            members[name] = plain[offset : offset + length]
            offset += length
        if offset != len(plain):
            raise ValueError("trailing bytes after the last member")
    except (ValueError, struct.error, UnicodeDecodeError, zstandard.ZstdError) as exc:
        raise IntegrityError(f"bank lexical index is damaged: {exc}") from None
    return starts, members
