"""Bank tables of the LMDB store: metadata, centroids, full-text index and cluster records in the ``banks``
database, each bank write one transaction.

The bank algorithms (``packstore/bank/bank.py``) work on any store with these ``bank*`` methods: the LMDB store
here, and the object tier (``store/objects/banks.py``), whose records are objects instead. What both share (record
names, the digest a bank signature covers) is the store core's ``store/bank_records.py``."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Protocol, TypeVar

import lmdb
import numpy as np

from packstore.errors import IntegrityError, InvalidInput, PackNotFound
from packstore.format.bank import BankMeta, Cluster, decode_centroids, decode_cluster, decode_lexical, encode_cluster
from packstore.format.signature import Signature
from packstore.store.bank_records import (
    BankChanged,
    centroids_record,
    check_records,
    cluster_prefix,
    digest_of,
    encode_records,
    lexical_record,
)
from packstore.store.lmdb_environment import LmdbEnvironment

T = TypeVar("T")
V = TypeVar("V", bound=bytes | memoryview)  # what a transaction hands out: bytes, or memoryviews with buffers


def _meta_key(name: str) -> bytes:
    return b"meta/" + name.encode()


def _centroids_key(name: str) -> bytes:
    return centroids_record(name).encode()


def _lexical_key(name: str) -> bytes:
    return lexical_record(name).encode()


def _cluster_prefix(name: str) -> bytes:
    return cluster_prefix(name).encode()


def _cluster_key(name: str, cluster: int) -> bytes:
    return _cluster_prefix(name) + struct.pack(">I", cluster)


def _signature_prefix(name: str) -> bytes:
    return b"signature/" + name.encode() + b"/"


def _record_key(name: str, record: str) -> bytes:
    """The LMDB key of a record named as ``record_names`` names it (cluster ids hex there, big-endian bytes here)."""
    prefix = _cluster_prefix(name)
    key = record.encode()
    return prefix + bytes.fromhex(key[len(prefix) :].decode()) if key.startswith(prefix) else key


class _LmdbStoreParts(Protocol):
    """What the bank tables use of the LmdbStore they are mixed into."""

    _env: LmdbEnvironment
    _banks: lmdb._Database | None

    def _write(self, body: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``body`` in one write transaction."""
        ...


class LmdbBankTables(_LmdbStoreParts):
    """Mixed into LmdbStore: every bank write is one LMDB transaction, like every pack write."""

    def _bank_db(self, name: str) -> lmdb._Database:
        if self._banks is None:  # a read-only store made before banks existed
            raise PackNotFound(f"no bank named {name!r}")
        return self._banks

    def _delete_bank_in(self, txn: lmdb.Transaction[bytes], name: str) -> bool:
        existed = txn.delete(_meta_key(name), db=self._banks)
        txn.delete(_centroids_key(name), db=self._banks)
        txn.delete(_lexical_key(name), db=self._banks)
        for prefix in (_cluster_prefix(name), _signature_prefix(name)):  # a rebuilt bank must be signed again
            cursor = txn.cursor(db=self._banks)
            if cursor.set_range(prefix):
                while cursor.key().startswith(prefix):
                    if not cursor.delete():
                        break
        return existed

    def put_bank(self, meta: BankMeta, centroids: np.ndarray, clusters: dict[int, Cluster], lexical: bytes) -> None:
        """Store (or replace) a whole bank atomically; ``lexical`` is its encoded full-text index record."""
        self._write_records(meta.name, meta.to_json(), encode_records(meta.name, centroids, clusters, lexical), replace=True)

    def put_bank_records(self, name: str, meta: bytes, records: dict[str, bytes]) -> None:
        """Store a new bank from its records as ``bank_records`` gives them, byte for byte (so its digest and
        signatures carry over: migrate), after checking each; BankChanged if the store holds a bank ``name``."""
        check_records(name, meta, records)
        self._write_records(name, meta, records, replace=False)

    def _write_records(self, name: str, meta: bytes, records: dict[str, bytes], *, replace: bool) -> None:
        """Write a whole bank's records in one transaction, replacing any bank of that name only if ``replace``."""

        def body(txn: lmdb.Transaction[bytes]) -> None:
            if not replace and txn.get(_meta_key(name), db=self._banks) is not None:
                raise BankChanged(name)
            self._delete_bank_in(txn, name)
            for record, data in records.items():
                txn.put(_record_key(name, record), data, db=self._banks)
            txn.put(_meta_key(name), meta, db=self._banks)

        self._write(body)

    def update_bank(self, meta: BankMeta, clusters: dict[int, Cluster], lexical: bytes, *, expected: BankMeta) -> None:
        """Replace some clusters, the full-text index and the metadata atomically (adding facts),
        only if the bank is still ``expected`` (the metadata the change was computed from):
        BankChanged otherwise, so a concurrent add or rebuild is never overwritten."""

        def body(txn: lmdb.Transaction[bytes]) -> None:
            current = txn.get(_meta_key(meta.name), db=self._banks)
            if current is None:
                raise PackNotFound(f"no bank named {meta.name!r}: it was removed while facts were being added")
            if BankMeta.from_json(current) != expected:
                raise BankChanged(meta.name)
            for cluster_id, cluster in clusters.items():
                txn.put(_cluster_key(meta.name, cluster_id), encode_cluster(cluster), db=self._banks)
            txn.put(_lexical_key(meta.name), lexical, db=self._banks)
            txn.put(_meta_key(meta.name), meta.to_json(), db=self._banks)

        self._write(body)

    def bank(self, name: str) -> BankMeta:
        self._bank_db(name)
        with self._env.read() as txn:
            data = txn.get(_meta_key(name), db=self._banks)
        if data is None:
            raise PackNotFound(f"no bank named {name!r}")
        return BankMeta.from_json(data)

    def bank_centroids(self, name: str) -> np.ndarray:
        self._bank_db(name)
        with self._env.read() as txn:
            data = txn.get(_centroids_key(name), db=self._banks)
        if data is None:
            raise PackNotFound(f"no bank named {name!r}")
        return decode_centroids(data)

    def bank_centroids_seal(self, name: str) -> bytes:
        """The sha256 that ends the centroid record: names one build's centroids without reading them."""
        seal = self._seal_of(_centroids_key(name), name)
        if seal is None:
            raise PackNotFound(f"no bank named {name!r}")
        return seal

    def bank_lexical_seal(self, name: str) -> bytes | None:
        """The sha256 that ends the lexical index record (None for a bank built without one)."""
        return self._seal_of(_lexical_key(name), name)

    def _seal_of(self, key: bytes, name: str) -> bytes | None:
        self._bank_db(name)
        with self._env.read(buffers=True) as txn:
            data = txn.get(key, db=self._banks)
            return None if data is None else bytes(data[-32:])

    def bank_lexical(self, name: str) -> tuple[np.ndarray, dict[str, bytes]] | None:
        """The bank's full-text index record, decoded: (cluster starts, library files); None if it has none."""
        self._bank_db(name)
        with self._env.read() as txn:
            data = txn.get(_lexical_key(name), db=self._banks)
        return None if data is None else decode_lexical(data)

    def bank_clusters(self, name: str, cluster_ids: list[int]) -> dict[int, Cluster | None]:
        """The given clusters (None for a cluster with no record: no facts yet)."""
        self._bank_db(name)
        found: dict[int, Cluster | None] = {}
        with self._env.read() as txn:
            for cluster_id in cluster_ids:
                data = txn.get(_cluster_key(name, cluster_id), db=self._banks)
                found[cluster_id] = decode_cluster(data) if data is not None else None
        return found

    def bank_stored_bytes(self, name: str) -> int:
        """Bytes of every value the bank stores (metadata, centroids, full-text index, clusters)."""
        with self._env.read() as txn:
            keys = (_meta_key(name), _centroids_key(name), _lexical_key(name))
            total = sum(len(txn.get(k, db=self._banks) or b"") for k in keys)
            cursor = txn.cursor(db=self._banks)
            prefix = _cluster_prefix(name)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    total += len(value)
        return total

    def bank_metas(self) -> list[BankMeta]:
        """Every bank's metadata record, in name order."""
        if self._banks is None:
            return []
        with self._env.read() as txn:
            cursor = txn.cursor(db=self._banks)
            metas = []
            if cursor.set_range(b"meta/"):
                for key, value in cursor:
                    if not key.startswith(b"meta/"):
                        break
                    metas.append(BankMeta.from_json(value))
        return metas

    def _records_in(self, txn: lmdb.Transaction[V], name: str) -> tuple[V, list[tuple[str, V]]]:
        """A bank's metadata record and every other record with its digest name, in digest order (buffers
        when ``txn`` was opened with them); PackNotFound if there is no such bank."""
        meta = txn.get(_meta_key(name), db=self._banks)
        if meta is None:
            raise PackNotFound(f"no bank named {name!r}")
        records: list[tuple[str, V]] = []
        for key in (_centroids_key(name), _lexical_key(name)):
            data = txn.get(key, db=self._banks)
            if data is not None:
                records.append((key.decode(), data))
        prefix = _cluster_prefix(name)
        cursor = txn.cursor(db=self._banks)
        if cursor.set_range(prefix):
            for found, value in cursor:
                key = bytes(found)  # a buffer in a read transaction opened with buffers
                if not key.startswith(prefix):
                    break
                records.append((prefix.decode() + key[len(prefix) :].hex(), value))
        return meta, records

    def _bank_digest_in(self, txn: lmdb.Transaction, name: str) -> str:
        meta, records = self._records_in(txn, name)
        return digest_of(name, bytes(meta), [(record, bytes(data[-32:])) for record, data in records])

    def bank_records(self, name: str) -> tuple[bytes, dict[str, bytes]]:
        """A bank's metadata record and every other record by digest name, as stored (one snapshot): what
        ``put_bank_records`` takes to copy the bank into another store with the same digest."""
        self._bank_db(name)
        with self._env.read() as txn:
            meta, records = self._records_in(txn, name)
        return meta, dict(records)

    def bank_digest(self, name: str) -> str:
        """The digest a bank's signature covers (docs/format.md §8): its metadata record's sha256 and
        every other record's own closing sha256, in key order; any change to the bank changes it."""
        self._bank_db(name)
        with self._env.read(buffers=True) as txn:
            return self._bank_digest_in(txn, name)

    def sign_bank(self, name: str, signature: Signature) -> None:
        """Store a signature with bank ``name`` after checking it signs the bank's current digest."""

        def body(txn: lmdb.Transaction[bytes]) -> None:
            signature.check("bank", self._bank_digest_in(txn, name))
            txn.put(_signature_prefix(name) + signature.key_id.encode(), signature.to_json(), db=self._banks)

        self._write(body)

    def bank_signatures(self, name: str) -> tuple[Signature, ...]:
        self._bank_db(name)
        found = []
        with self._env.read() as txn:
            prefix = _signature_prefix(name)
            cursor = txn.cursor(db=self._banks)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    try:
                        found.append(Signature.from_json(value))
                    except InvalidInput as exc:
                        raise IntegrityError(f"bank {name!r}: a stored signature is damaged: {exc}") from None
        return tuple(found)

    def delete_bank(self, name: str) -> None:
        def body(txn: lmdb.Transaction[bytes]) -> None:
            if not self._delete_bank_in(txn, name):
                raise PackNotFound(f"no bank named {name!r}")

        self._write(body)
