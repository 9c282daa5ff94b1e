"""Bank records: metadata JSON, centroid matrix, one blob per cluster (fp16 embeddings + texts), lexical index.

Each binary record ends with the sha256 of what precedes it, so damage is detected on read.
See docs/format.md §6.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

import numpy as np
import zstandard

from packstore.errors import IntegrityError
from packstore.format.header import canonical_json

BANK_FORMAT = "packstore-bank"
BANK_VERSION = 1
CLUSTER_MAGIC = b"PSBK"
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

    def to_json(self) -> bytes:
        return canonical_json(asdict(self) | {"format": BANK_FORMAT, "version": BANK_VERSION})

    @classmethod
    def from_json(cls, data: bytes) -> "BankMeta":
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


@dataclass
class Cluster:
    """The facts of one cluster: ids, unit embeddings (fp16 on disk) and texts, in the same order."""

    ids: np.ndarray  # uint32 [n]
    embeddings: np.ndarray  # float16 [n, dim]
    texts: list[str]


def encode_cluster(cluster: Cluster) -> bytes:
    n, dim = cluster.embeddings.shape
    encoded = [t.encode("utf-8") for t in cluster.texts]
    parts = [
        _PREAMBLE.pack(CLUSTER_MAGIC, BANK_VERSION, n, dim),
        np.ascontiguousarray(cluster.ids, dtype="<u4").tobytes(),
        np.ascontiguousarray(cluster.embeddings, dtype="<f2").tobytes(),
        np.array([len(t) for t in encoded], dtype="<u4").tobytes(),
        b"".join(encoded),
    ]
    return _seal(b"".join(parts))


def decode_cluster(data: bytes) -> Cluster:
    body, n, dim = _unseal(data, CLUSTER_MAGIC, "bank cluster")
    try:
        ids = np.frombuffer(body, dtype="<u4", count=n)
        offset = 4 * n
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
    return Cluster(ids=ids, embeddings=embeddings, texts=texts)


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
