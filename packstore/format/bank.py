"""Bank records: metadata JSON, centroid matrix, and one blob per cluster (fp16 embeddings + texts).

Each binary record ends with the sha256 of what precedes it, so damage is detected on read.
See docs/format.md §6.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

import numpy as np

from packstore.errors import IntegrityError
from packstore.format.header import canonical_json

BANK_FORMAT = "packstore-bank"
BANK_VERSION = 1
CLUSTER_MAGIC = b"PSBK"
CENTROIDS_MAGIC = b"PSBC"
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
