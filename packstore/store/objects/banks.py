"""Banks on the object tier: the same ``bank*`` methods as the LMDB store's ``LmdbBankTables``, over objects.

A bank's records (centroids, full-text index, one per cluster) are immutable objects
``banks/NAME/records/WRITE/RECORD``, new for every write; its head is a register
(``registers.py``) ``banks/NAME/head`` whose newest version names every record with its sha256,
closing seal and size, and holds the metadata and signatures. A write uploads its records first
and commits them with one new head version, so a bank is whole or absent for every replica, and
an add computed from a bank that changed meanwhile loses the compare-and-swap (``BankChanged``)
and is computed again. gc removes records no newest head names once they are older than the grace.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from packstore.errors import IntegrityError, InvalidInput, PackNotFound, Unavailable
from packstore.format.bank import BankMeta, Cluster, decode_centroids, decode_cluster, decode_lexical, encode_cluster
from packstore.format.signature import Signature
from packstore.store.bank_records import BankChanged, check_records, digest_of, encode_records, record_names
from packstore.store.objects.bucket import Bucket
from packstore.store.objects.registers import Registers, Version
from packstore.store.protocol import check_name


class _ObjectStoreParts(Protocol):
    """What the bank methods use of the ``ObjectStore`` they are mixed into."""

    _base: str
    bucket: Bucket
    _registers: Registers
    _pool: ThreadPoolExecutor

    @property
    def writer_window(self) -> float: ...

    def _immutable(self, name: str, check: Callable[[bytes], None], *, cached: bool = True, missing: str) -> bytes: ...


class ObjectBankTables(_ObjectStoreParts):
    """Mixed into ObjectStore. A head's value: ``{"meta": JSON, "records": {RECORD: [object, sha256, seal, size]},
    "signatures": [JSON, ...]}``; RECORD is the name the bank digest gives it (``record_names``)."""

    def _bank_head_path(self, name: str) -> str:
        return f"{self._base}banks/{check_name(name)}/head"

    def _bank_head(self, name: str) -> dict[str, Any]:
        """The newest head of bank ``name``; PackNotFound if there is no such bank."""
        return _value(self._registers.latest(self._bank_head_path(name)), name)

    def _bank_record(self, name: str, head: dict[str, Any], record: str) -> bytes | None:
        """One record's bytes, checked against the sha256 its head gives (None: the bank has no such record)."""
        entry = head["records"].get(record)
        return None if entry is None else self._record_object(name, record, entry)

    def _record_object(self, name: str, record: str, entry: list[Any]) -> bytes:
        """The bytes of ``record``, whose head entry is ``entry``, checked against the sha256 the entry gives."""
        obj, sha256 = entry[0], entry[1]

        def check(data: bytes) -> None:
            if hashlib.sha256(data).hexdigest() != sha256:
                raise IntegrityError(f"bank {name!r}: record {record} is damaged: checksum mismatch")

        return self._immutable(obj, check, missing=f"bank {name!r}: record {record} is missing from the object store")

    def _upload_records(self, name: str, records: dict[str, bytes]) -> dict[str, list[str | int]]:
        """Upload new record objects (fresh names, so no gc can count them old) within the writer window. The upload's
        duration is timed on this host's monotonic clock: the store's clock (HTTP Date) counts whole seconds, which
        would fail an upload of a moment that crossed a second boundary whenever the window is under 2 s."""
        started = time.monotonic()
        write = uuid.uuid4().hex
        items = list(records.items())

        def upload(index: int) -> list[str | int]:
            record, data = items[index]
            obj = f"{self._base}banks/{name}/records/{write}/{index:08x}"
            self.bucket.put(obj, data, create_only=True)
            return [obj, hashlib.sha256(data).hexdigest(), data[-32:].hex(), len(data)]

        entries = dict(zip((record for record, _ in items), self._pool.map(upload, range(len(items)))))
        if time.monotonic() - started >= self.writer_window:
            raise Unavailable(f"the object store is too slow: uploading bank {name!r} took longer than {self.writer_window:.0f} s")
        return entries

    def put_bank(self, meta: BankMeta, centroids: np.ndarray, clusters: dict[int, Cluster], lexical: bytes) -> None:
        """Store (or replace) a whole bank: its records, then one head version naming them (without signatures)."""
        self._commit_records(meta.name, meta.to_json(), encode_records(meta.name, centroids, clusters, lexical), replace=True)

    def put_bank_records(self, name: str, meta: bytes, records: dict[str, bytes]) -> None:
        """Store a new bank from its records as ``bank_records`` gives them, byte for byte (so its digest and
        signatures carry over: migrate), after checking each; BankChanged if the store holds a bank ``name``."""
        check_records(name, meta, records)
        self._commit_records(name, meta, records, replace=False)

    def _commit_records(self, name: str, meta: bytes, records: dict[str, bytes], *, replace: bool) -> None:
        """Upload a whole bank's records, then commit one head version naming them, over any bank of that
        name only if ``replace`` (BankChanged otherwise)."""
        path = self._bank_head_path(name)  # checks the name before anything is uploaded
        head = {"meta": meta.decode(), "records": self._upload_records(name, records), "signatures": []}

        def change(current: Version | None) -> dict[str, Any]:
            if not replace and current is not None and current.value is not None:
                raise BankChanged(name)
            return head

        self._registers.update(path, change)

    def update_bank(self, meta: BankMeta, clusters: dict[int, Cluster], lexical: bytes, *, expected: BankMeta) -> None:
        """Replace some clusters, the full-text index and the metadata in one head version, only if the bank
        is still ``expected``: BankChanged otherwise, so a concurrent add or rebuild is never overwritten."""
        _, lexical_name, cluster_names = record_names(meta.name, sorted(clusters))
        records = {lexical_name: lexical} | {record: encode_cluster(clusters[c]) for record, c in zip(cluster_names, sorted(clusters))}
        entries = self._upload_records(meta.name, records)

        def change(current: Version | None) -> dict[str, Any]:
            head = _value(current, meta.name, gone="it was removed while facts were being added")
            if BankMeta.from_json(head["meta"].encode()) != expected:
                raise BankChanged(meta.name)
            return head | {"meta": meta.to_json().decode(), "records": head["records"] | entries}

        self._registers.update(self._bank_head_path(meta.name), change)

    def bank(self, name: str) -> BankMeta:
        return _meta(self._bank_head(name), name)

    def bank_centroids(self, name: str) -> np.ndarray:
        head = self._bank_head(name)
        centroids = record_names(name, [])[0]
        return decode_centroids(self._record_object(name, centroids, head["records"][centroids]))

    def bank_centroids_seal(self, name: str) -> bytes:
        """The sha256 that ends the centroid record: names one build's centroids without reading them."""
        return bytes.fromhex(self._bank_head(name)["records"][record_names(name, [])[0]][2])

    def bank_lexical_seal(self, name: str) -> bytes | None:
        entry = self._bank_head(name)["records"].get(record_names(name, [])[1])
        return None if entry is None else bytes.fromhex(entry[2])

    def bank_lexical(self, name: str) -> tuple[np.ndarray, dict[str, bytes]] | None:
        data = self._bank_record(name, self._bank_head(name), record_names(name, [])[1])
        return None if data is None else decode_lexical(data)

    def bank_clusters(self, name: str, cluster_ids: list[int]) -> dict[int, Cluster | None]:
        """The given clusters, fetched several at a time (a cluster with no facts yet is None)."""
        head = self._bank_head(name)
        found = self._pool.map(lambda record: self._bank_record(name, head, record), record_names(name, cluster_ids)[2])
        return {c: decode_cluster(data) if data is not None else None for c, data in zip(cluster_ids, found)}

    def bank_records(self, name: str) -> tuple[bytes, dict[str, bytes]]:
        """A bank's metadata record and every other record by digest name, each checked against its head (one
        head version): what ``put_bank_records`` takes to copy the bank into another store with the same digest."""
        head = self._bank_head(name)
        ordered = _ordered(name, head)
        found = self._pool.map(lambda record: self._record_object(name, record, head["records"][record]), ordered)
        return head["meta"].encode(), dict(zip(ordered, found))

    def bank_stored_bytes(self, name: str) -> int:
        """Bytes of the bank's metadata and every record its head names."""
        head = self._bank_head(name)
        return len(head["meta"].encode()) + sum(int(entry[3]) for entry in head["records"].values())

    def bank_metas(self) -> list[BankMeta]:
        """Every bank's metadata, in name order."""
        metas = []
        for name in self.bucket.folders(f"{self._base}banks/"):
            version = self._registers.latest(self._bank_head_path(name))
            if version is not None and version.value is not None:
                metas.append(_meta(_value(version, name), name))
        return metas

    def bank_digest(self, name: str) -> str:
        """The digest a bank's signature covers: the same as the LMDB store gives the same bank (docs/format.md §8)."""
        return _digest(name, self._bank_head(name))

    def sign_bank(self, name: str, signature: Signature) -> None:
        """Store a signature with bank ``name`` (one per key) after checking it signs the current digest."""

        def change(current: Version | None) -> dict[str, Any]:
            head = _value(current, name)
            signature.check("bank", _digest(name, head))
            kept = [s for s in head["signatures"] if Signature.from_json(s.encode()).key_id != signature.key_id]
            return head | {"signatures": kept + [signature.to_json().decode()]}

        self._registers.update(self._bank_head_path(name), change)

    def bank_signatures(self, name: str) -> tuple[Signature, ...]:
        try:
            return tuple(Signature.from_json(s.encode()) for s in self._bank_head(name)["signatures"])
        except InvalidInput as exc:
            raise IntegrityError(f"bank {name!r}: a stored signature is damaged: {exc}") from None

    def delete_bank(self, name: str) -> None:
        """Remove a bank (one head version saying so); its records are left to gc."""
        def clear(current: Version | None) -> None:
            _value(current, name)  # PackNotFound if there is no such bank

        self._registers.update(self._bank_head_path(name), clear)

    def _prune_banks(self, cutoff: float) -> list[str]:
        """For gc: of each bank unchanged since ``cutoff`` (so no reader still holds an older head), the
        records its newest head does not name that are older than ``cutoff``, and its older head versions."""
        doomed: list[str] = []
        for name in self.bucket.folders(f"{self._base}banks/"):
            path = self._bank_head_path(name)
            listed = self._registers.versions(f"{path}/").get(path, [])
            if listed and listed[-1].modified.timestamp() >= cutoff:
                continue
            newest = self._registers.newest(listed)  # None: the bank's first build never committed
            referenced = {entry[0] for entry in _value(newest, name)["records"].values()} if newest and newest.value is not None else set()
            records = self.bucket.list(f"{self._base}banks/{name}/records/")
            doomed += [v.name for v in listed[:-1]]
            doomed += [o.name for o in records if o.name not in referenced and o.modified.timestamp() < cutoff]
        return doomed

def _value(version: Version | None, name: str, *, gone: str = "") -> dict[str, Any]:
    if version is None or version.value is None:
        raise PackNotFound(f"no bank named {name!r}" + (f": {gone}" if gone else ""))
    if not isinstance(version.value, dict) or not {"meta", "records", "signatures"} <= version.value.keys():
        raise IntegrityError(f"bank {name!r}: its head {version.name} is damaged")
    return version.value


def _meta(head: dict[str, Any], name: str) -> BankMeta:
    try:
        return BankMeta.from_json(head["meta"].encode())
    except (InvalidInput, AttributeError) as exc:
        raise IntegrityError(f"bank {name!r}: its metadata is damaged: {exc}") from None


def _ordered(name: str, head: dict[str, Any]) -> list[str]:
    """The records a head names, in digest order: centroids, lexical index, then clusters by id."""
    centroids, lexical, _ = record_names(name, [])
    clusters = sorted(record for record in head["records"] if record not in (centroids, lexical))
    return [record for record in (centroids, lexical) if record in head["records"]] + clusters


def _digest(name: str, head: dict[str, Any]) -> str:
    records = [(record, bytes.fromhex(head["records"][record][2])) for record in _ordered(name, head)]
    return digest_of(name, head["meta"].encode(), records)
