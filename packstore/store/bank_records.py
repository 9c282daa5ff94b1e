"""What every tier's banks share, in the store core: the names of a bank's records, their encoding and checks, the
digest a bank signature covers, and ``StoredBanks`` (list, size, delete, digest, signatures and signing, without an
embedder).

Record names (``record_names``) are the names the digest gives each record and the object tier's object names; the
LMDB tier keys its records by them. ``bank.bank.LocalBanks`` adds building, adding and routing (which embed) on top
of ``StoredBanks``; migrate and the other store-only tools use it alone, so they need no model stack."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable

import numpy as np

from packstore.errors import IntegrityError, InvalidInput
from packstore.format.bank import BankMeta, Cluster, decode_centroids, decode_cluster, decode_lexical, encode_centroids, encode_cluster
from packstore.format.header import canonical_json
from packstore.format.signature import Signature
from packstore.store.protocol import BankAdmin


class BankChanged(Exception):
    """The bank changed between reading it and writing an update computed from it: compute again."""


def centroids_record(name: str) -> str:
    return f"centroids/{name}"


def lexical_record(name: str) -> str:
    return f"lexical/{name}"


def cluster_prefix(name: str) -> str:
    """What the names of a bank's cluster records start with (the cluster id follows, as 8 hex digits)."""
    return f"cluster/{name}/"


def record_names(name: str, cluster_ids: list[int]) -> tuple[str, str, list[str]]:
    """How a bank's records are named in its digest (and in the object tier): centroids, lexical index, clusters."""
    prefix = cluster_prefix(name)
    return centroids_record(name), lexical_record(name), [prefix + struct.pack(">I", c).hex() for c in cluster_ids]


def encode_records(name: str, centroids: np.ndarray, clusters: dict[int, Cluster], lexical: bytes) -> dict[str, bytes]:
    """A whole bank's records by the names ``record_names`` gives them, in digest order: centroids, lexical index, clusters by id."""
    centroids_name, lexical_name, cluster_names = record_names(name, sorted(clusters))
    records = {centroids_name: encode_centroids(centroids), lexical_name: lexical}
    return records | {record: encode_cluster(clusters[c]) for record, c in zip(cluster_names, sorted(clusters))}


def check_records(name: str, meta: bytes, records: dict[str, bytes]) -> None:
    """Refuse records that are not a whole, undamaged bank ``name`` (before a store takes a copied bank):
    metadata of another bank, no centroids, a record of unknown name, or one that does not decode."""
    if (found := BankMeta.from_json(meta).name) != name:
        raise InvalidInput(f"bank {name!r}: the metadata record given names bank {found!r}")
    centroids, lexical, _ = record_names(name, [])
    if centroids not in records:
        raise InvalidInput(f"bank {name!r}: the records hold no centroids")
    cluster = re.compile(re.escape(cluster_prefix(name)) + "[0-9a-f]{8}")
    decode: Callable[[bytes], object]
    for record, data in records.items():
        if record == centroids:
            decode = decode_centroids
        elif record == lexical:
            decode = decode_lexical
        elif cluster.fullmatch(record):
            decode = decode_cluster
        else:
            raise InvalidInput(f"bank {name!r}: {record!r} is not a record of it")
        try:
            decode(data)
        except IntegrityError as exc:
            raise IntegrityError(f"bank {name!r}: record {record}: {exc}") from None


def digest_of(name: str, meta: bytes, records: list[tuple[str, bytes]]) -> str:
    """The digest a bank signature covers (docs/format.md §8): its metadata record's sha256 and each
    other record's name and closing sha256 (``records``: centroids, lexical, then clusters by id)."""
    record = {"bank": name, "meta": hashlib.sha256(meta).hexdigest(), "records": [[key, seal.hex()] for key, seal in records]}
    return hashlib.sha256(canonical_json(record)).hexdigest()


class StoredBanks:
    """The banks kept in ``store``'s bank tables, as records."""

    def __init__(self, store: BankAdmin) -> None:
        self.store = store

    def list(self) -> list[tuple[BankMeta, int]]:
        """Every bank with its stored bytes."""
        return [(meta, self.store.bank_stored_bytes(meta.name)) for meta in self.store.bank_metas()]

    def stored_bytes(self, name: str) -> int:
        self.store.bank(name)
        return self.store.bank_stored_bytes(name)

    def delete(self, name: str) -> None:
        self.store.delete_bank(name)

    def digest(self, name: str) -> str:
        return self.store.bank_digest(name)

    def signatures(self, name: str) -> tuple[Signature, ...]:
        return self.store.bank_signatures(name)

    def sign(self, name: str, signature: Signature) -> None:
        self.store.sign_bank(name, signature)
