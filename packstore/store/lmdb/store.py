"""LMDB-backed pack store: headers, chunks and names written in one transaction per put."""

from __future__ import annotations

import builtins
import fcntl
import itertools
import os
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import lmdb

from packstore.errors import IntegrityError, InvalidInput, PackNotFound, StoreBusy, Unavailable
from packstore.format import EncodedPack, PackHeader, parse_key
from packstore.format.body import chunks_for, verify_chunk, verify_chunk_info
from packstore.format.header import ChunkInfo
from packstore.format.signature import Signature
from packstore.store.lmdb.banks import LmdbBankTables
from packstore.store.lmdb.integrity import check_structure
from packstore.store.lmdb_environment import DEFAULT_MAP_SIZE, LmdbEnvironment
from packstore.store.protocol import (
    DEFAULT_PAGE,
    HASH_PREFIX,
    MAX_PAGE,
    BacksUp,
    BankRecords,
    OpenedPack,
    ServedStore,
    check_name,
    pick_match,
)
from packstore.store.records import GcReport, PackPage, PackSummary, StoreCounts, StoredPack
from packstore.store.summaries import pack_stored_bytes, parse_summary, summary_record

STORE_LAYOUT_VERSION = b"2"  # 2 added summaries, key_names, by_name and the running counters
LOCK_FILE = "packstore.lock"
STALE_UPLOAD_SECONDS = 3600
STREAM_BATCH_BYTES = 64 << 20  # chunks of a pack written as it is made (``LmdbStream``) go to disk this many bytes a transaction
CLAIM = b"@claim"  # a ``staging`` key ending so is a stream's claim on a pack key (its value: "<unix time> <pack key>")
T = TypeVar("T")
V = TypeVar("V", bound=bytes | memoryview)  # what a transaction hands out: bytes, or memoryviews with buffers


def _chunk_key(key: str, index: int) -> bytes:
    return key.encode() + b"#" + struct.pack(">I", index)


def _pack_of_chunk(chunk_key: bytes) -> str:
    """The pack key of a ``_chunk_key``: all but the ``#`` and the four bytes of the index (which may hold a ``#``)."""
    return chunk_key[:-5].decode(errors="replace")


def _signature_key(key: str, signer: str) -> bytes:
    """``signatures`` entry: the pack key, then the signing key's id."""
    return f"{key}/{signer}".encode()


def _name_key(model_fp: str, name: str) -> bytes:
    return f"{model_fp}/{name}".encode()


def _key_name_key(key: str, name: str) -> bytes:
    """``key_names`` entry: the pack key, then one of its names (names hold no ``/``)."""
    return f"{key}/{name}".encode()


def _by_name_key(name: str, model_fp: str) -> bytes:
    """``by_name`` entry: a name, then the model it is scoped to."""
    return f"{name}/{model_fp}".encode()


def _prefix_scan(txn: lmdb.Transaction[V], db: lmdb._Database | None, prefix: bytes) -> Iterator[tuple[bytes, V]]:
    """Every (key, value) of ``db`` whose key starts with ``prefix``, in key order (keys as bytes, also in a
    ``buffers`` transaction, whose values stay memoryviews)."""
    cursor = txn.cursor(db=db)
    if not cursor.set_range(prefix):
        return
    for found, value in cursor:
        key = bytes(found)
        if not key.startswith(prefix):
            return
        yield key, value


def _claims_in(txn: lmdb.Transaction[bytes], staging: lmdb._Database | None) -> Iterator[tuple[bytes, tuple[float, str]]]:
    """Every stream's claim in ``staging``: (its staging key, (when it was last refreshed, the pack key it claims))."""
    for found in txn.cursor(db=staging).iternext(values=False):
        if found.endswith(CLAIM):
            when, key = (txn.get(found, db=staging) or b"0 ").decode().split(" ", 1)
            yield bytes(found), (float(when), key)


def _claim_value(key: str) -> bytes:
    return f"{time.time():.0f} {key}".encode()


def _names_at(cursor: lmdb.Cursor[bytes], key: str) -> tuple[str, ...]:
    """The names of ``key`` in ``key_names``, sorted; ``cursor`` may be reused for keys in increasing order."""
    prefix = f"{key}/".encode()
    names = []
    if cursor.set_range(prefix):
        found = cursor.key()
        while found.startswith(prefix):
            names.append(found[len(prefix) :].decode())
            if not cursor.next():
                break
            found = cursor.key()
    return tuple(names)


class LmdbStore(LmdbBankTables):
    """The embedded store: a directory holding one LMDB environment (databases in docs/format.md §2).

    Every write is one LMDB write transaction, so a pack is either fully present or absent.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE, max_bytes: int | None = None
    ) -> None:
        """``map_size``: the address space the LMDB map reserves at open (docs/operations.md, "Threads,
        processes and the map"); the data file grows only as data is stored. ``max_bytes``: the most the
        data file may hold; past it writes fail with LimitExceeded while reads go on."""
        self.path = Path(path)
        self.readonly = readonly
        self._map_size = map_size
        self._max_bytes = max_bytes
        if readonly and not (self.path / "data.mdb").exists():
            raise PackNotFound(f"no pack store at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        if (self.path / "data.mdb").exists():
            check_structure(self.path, map_size)  # a damaged file is refused here, never mapped into a crash
        # Every open holds a shared advisory lock; compaction, which swaps the data file, needs it exclusive.
        self._lock = open(self.path / LOCK_FILE, "rb" if readonly and (self.path / LOCK_FILE).exists() else "a+b")
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        try:
            self._open_env()
        except lmdb.NotFoundError:  # a layout-1 store, opened read-only, lacks the listing databases
            self._env.close()
            self._upgrade_layout()
            self._open_env()

    def _upgrade_layout(self) -> None:
        """Bring an older store's layout up to date with one writable open, for a read-only caller."""
        try:
            LmdbStore(self.path, map_size=self._map_size).close()
        except (OSError, lmdb.Error) as exc:
            raise IntegrityError(f"store {self.path} has an older layout and cannot be upgraded here: {exc}") from None

    def _open_env(self) -> None:
        self._env = LmdbEnvironment(self.path, map_size=self._map_size, readonly=self.readonly, max_dbs=16, max_size=self._max_bytes)
        self._open_dbs()

    def _open_dbs(self) -> None:
        """Open the databases (creating them and bringing the layout up to date when writable); check the layout."""
        readonly = self.readonly
        self._meta = self._env.open_db(b"meta", create=not readonly)
        self._packs = self._env.open_db(b"packs", create=not readonly)
        self._chunks = self._env.open_db(b"chunks", create=not readonly)
        self._names = self._env.open_db(b"names", create=not readonly)
        self._summaries = self._env.open_db(b"summaries", create=not readonly)
        self._key_names = self._env.open_db(b"key_names", create=not readonly)
        self._by_name = self._env.open_db(b"by_name", create=not readonly)
        self._staging = self._env.open_db(b"staging", create=not readonly) if not readonly else None
        self._banks = self._env.open_db(b"banks", create=not readonly) if not readonly or self._has_db(b"banks") else None
        self._signatures = self._env.open_db(b"signatures", create=not readonly) if not readonly or self._has_db(b"signatures") else None
        if not readonly:
            self._write(self._upgrade_in)
        with self._env.read() as txn:
            layout = txn.get(b"layout", db=self._meta)
        if layout is not None and layout != STORE_LAYOUT_VERSION:
            raise IntegrityError(
                f"store {self.path} has layout {layout.decode(errors='replace')}, this build reads {STORE_LAYOUT_VERSION.decode()}"

            )

    def _upgrade_in(self, txn: lmdb.Transaction[bytes]) -> None:
        """Stamp a new store with the layout; bring a layout-1 store's indexes and counters up to date."""
        layout = txn.get(b"layout", db=self._meta)
        if layout == STORE_LAYOUT_VERSION:
            return
        if layout not in (None, b"1"):
            return  # a newer layout: refused by the caller, never rewritten
        packs = stored_bytes = 0
        for key, data in txn.cursor(db=self._packs):
            try:
                header = PackHeader.from_json(data)
            except (IntegrityError, InvalidInput):
                continue  # a damaged header stays listed by keys() and reported by verify
            size = pack_stored_bytes(header, data)
            packs, stored_bytes = packs + 1, stored_bytes + size
            txn.put(key, summary_record(header, size), db=self._summaries)
        for name_key, key in txn.cursor(db=self._names):
            model_fp, name = name_key.decode().split("/", 1)
            txn.put(_key_name_key(key.decode(), name), b"", db=self._key_names)
            txn.put(_by_name_key(name, model_fp), key, db=self._by_name)
        self._set_counts_in(txn, StoreCounts(packs=packs, stored_bytes=stored_bytes))
        txn.put(b"layout", STORE_LAYOUT_VERSION, db=self._meta)

    def _counts_in(self, txn: lmdb.Transaction[bytes]) -> StoreCounts:
        data = txn.get(b"counts", db=self._meta)
        packs, stored_bytes = struct.unpack("<QQ", data) if data is not None else (0, 0)
        return StoreCounts(packs=packs, stored_bytes=stored_bytes)

    def _set_counts_in(self, txn: lmdb.Transaction[bytes], counts: StoreCounts) -> None:
        txn.put(b"counts", struct.pack("<QQ", counts.packs, counts.stored_bytes), db=self._meta)

    def _add_counts_in(self, txn: lmdb.Transaction[bytes], packs: int, stored_bytes: int) -> None:
        now = self._counts_in(txn)
        self._set_counts_in(txn, StoreCounts(packs=now.packs + packs, stored_bytes=now.stored_bytes + stored_bytes))

    def _has_db(self, name: bytes) -> bool:
        with self._env.read() as txn:
            return txn.get(name) is not None

    def close(self) -> None:
        self._env.close()
        self._lock.close()

    def __enter__(self) -> LmdbStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, body: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``body`` in one write transaction (rerun in a fresh one if the map had to grow)."""
        return self._env.write(body)

    # -- writes ---------------------------------------------------------------------------

    def put(self, encoded: EncodedPack, *, name: str | None = None) -> tuple[str, bool]:
        """Store a pack (and optionally name it). Returns ``(key, created)``; same content is stored once."""
        header = encoded.header
        header.validate(encoded=True)
        if len(encoded.chunks) != len(header.chunks):
            raise InvalidInput(f"pack has {len(encoded.chunks)} chunks, header lists {len(header.chunks)}")
        for index, data in enumerate(encoded.chunks):
            verify_chunk(header, index, data)
        encoded.check_signatures()
        if name is not None:
            check_name(name)
        return header.key, self._write(lambda txn: self._commit_in(txn, header, encoded.chunks.__getitem__, name, encoded.signatures))

    def _commit_in(
        self,
        txn: lmdb.Transaction[bytes],
        header: PackHeader,
        chunk: Callable[[int], bytes] | None,
        name: str | None,
        signatures: tuple[Signature, ...] = (),
    ) -> bool:
        """Write chunks (``chunk(i)`` gives chunk i; None: they are in place already), header and name unless the key
        is stored, and any (checked) signatures; True if new."""
        key = header.key
        created = txn.get(key.encode(), db=self._packs) is None
        if created:
            for index in range(len(header.chunks) if chunk is not None else 0):
                assert chunk is not None
                txn.put(_chunk_key(key, index), chunk(index), db=self._chunks)
            header_json = header.to_json()
            size = pack_stored_bytes(header, header_json)
            txn.put(key.encode(), header_json, db=self._packs)
            txn.put(key.encode(), summary_record(header, size), db=self._summaries)
            self._add_counts_in(txn, 1, size)
        if name is not None:
            self._name_in(txn, header.model_fp, name, key)
        for signature in signatures:
            txn.put(_signature_key(key, signature.key_id), signature.to_json(), db=self._signatures)
        return created

    def add_signature(self, ref: str, signature: Signature, *, model_fp: str | None = None) -> str:
        """Store ``signature`` with the pack ``ref`` (one per signing key: a newer one replaces it),
        after checking that it signs this pack's digest and verifies; returns the key."""
        key = self.resolve(ref, model_fp=model_fp)

        def body(txn: lmdb.Transaction[bytes]) -> None:
            signature.check("pack", self._header_in(txn, key).pack_sha256)
            txn.put(_signature_key(key, signature.key_id), signature.to_json(), db=self._signatures)

        self._write(body)
        return key

    def _signatures_in(self, txn: lmdb.Transaction[bytes], key: str) -> tuple[Signature, ...]:
        if self._signatures is None:
            return ()
        found = []
        for _, data in _prefix_scan(txn, self._signatures, f"{key}/".encode()):
            try:
                found.append(Signature.from_json(bytes(data)))
            except InvalidInput as exc:
                raise IntegrityError(f"pack {key}: a stored signature is damaged: {exc}") from None
        return tuple(found)

    def _name_in(self, txn: lmdb.Transaction[bytes], model_fp: str, name: str, key: str) -> None:
        """Point ``name`` (of ``model_fp``) at ``key`` and keep both name indexes in step."""
        previous = txn.get(_name_key(model_fp, name), db=self._names)
        if previous is not None:
            txn.delete(_key_name_key(previous.decode(), name), db=self._key_names)
        txn.put(_name_key(model_fp, name), key.encode(), db=self._names)
        txn.put(_key_name_key(key, name), b"", db=self._key_names)
        txn.put(_by_name_key(name, model_fp), key.encode(), db=self._by_name)

    def _unname_in(self, txn: lmdb.Transaction[bytes], model_fp: str, name: str) -> str | None:
        """Remove one name and its index entries; returns the key it pointed at."""
        found = txn.pop(_name_key(model_fp, name), db=self._names)
        if found is None:
            return None
        txn.delete(_key_name_key(found.decode(), name), db=self._key_names)
        txn.delete(_by_name_key(name, model_fp), db=self._by_name)
        return found.decode()

    def set_name(self, ref: str, name: str, *, model_fp: str | None = None) -> str:
        """Point ``name`` at the pack ``ref`` (within the pack's model); returns the key."""
        check_name(name)
        key = self.resolve(ref, model_fp=model_fp)
        model = parse_key(key)[0]  # type: ignore[index]
        self._write(lambda txn: self._name_in(txn, model, name, key))
        return key

    def delete_name(self, name: str, *, model_fp: str) -> str:
        """Remove one name of one model (the pack stays); returns the key it pointed at."""

        def body(txn: lmdb.Transaction[bytes]) -> str:
            found = self._unname_in(txn, model_fp, name)
            if found is None:
                raise PackNotFound(f"no pack named {name!r} for model {model_fp[:12]}", ref=name)
            return found

        return self._write(body)

    def delete(self, ref: str, *, model_fp: str | None = None) -> str:
        """Remove a pack, its chunks and every name pointing at it, in one transaction; returns the key."""
        key = self.resolve(ref, model_fp=model_fp)

        def body(txn: lmdb.Transaction[bytes]) -> None:
            header = self._header_in(txn, key)
            size = pack_stored_bytes(header, self._header_json_in(txn, key))
            for index in range(len(header.chunks)):
                txn.delete(_chunk_key(key, index), db=self._chunks)
            txn.delete(key.encode(), db=self._packs)
            if txn.delete(key.encode(), db=self._summaries):
                self._add_counts_in(txn, -1, -size)
            for name in self._names_in(txn, key):
                self._unname_in(txn, header.model_fp, name)
            for signature_key, _ in list(_prefix_scan(txn, self._signatures, f"{key}/".encode())):
                txn.delete(signature_key, db=self._signatures)

        self._write(body)
        return key

    # -- reads ----------------------------------------------------------------------------

    def resolve(self, ref: str, *, model_fp: str | None = None) -> str:
        """Turn a REF into a stored key: a full key, a name, or a unique prefix (8+ hex) of a content hash.

        Names and prefixes are looked up among ``model_fp``'s packs when it is given.
        """
        with self._env.read() as txn:
            if parse_key(ref):
                if txn.get(ref.encode(), db=self._packs) is None:
                    self._missing(txn, ref)
                return ref
            if model_fp is not None:
                found = txn.get(_name_key(model_fp, ref), db=self._names)
                matches = [found.decode()] if found is not None else []
            else:
                matches = [v.decode() for _, v in _prefix_scan(txn, self._by_name, f"{ref}/".encode())]
            by_name = bool(matches)
            if not matches and HASH_PREFIX.fullmatch(ref):
                within = f"{model_fp}/".encode() if model_fp else b""
                matches = [
                    key
                    for key in (k.decode() for k in txn.cursor(db=self._packs).iternext(values=False) if k.startswith(within))
                    if key.rsplit("/", 1)[1].startswith(ref)
                ]
        return pick_match(ref, matches, by_name=by_name, model_fp=model_fp)

    def _header_json_in(self, txn: lmdb.Transaction[V], key: str) -> V:
        """The stored header of ``key`` as ``txn`` holds it; PackNotFound (or IntegrityError) when it is missing."""
        data = txn.get(key.encode(), db=self._packs)
        if data is None:
            self._missing(txn, key)
        return data

    def _header_in(self, txn: lmdb.Transaction, key: str) -> PackHeader:
        data = self._header_json_in(txn, key)
        try:
            header = PackHeader.from_json(bytes(data))  # a memoryview in a buffers transaction
        except (IntegrityError, InvalidInput) as exc:
            raise IntegrityError(f"pack {key}: stored header is damaged: {exc}") from None
        if header.key != key:
            raise IntegrityError(f"pack {key}: stored header describes a different key")
        return header

    def _missing(self, txn: lmdb.Transaction, key: str) -> NoReturn:
        """A key with no header: PackNotFound, unless the store's own index still lists it, which only
        damage to the file can cause (DATA_LOSS: a pack never vanishes silently)."""
        if txn.get(key.encode(), db=self._summaries) is not None:
            raise IntegrityError(f"pack {key}: its header is missing from the store (the file is damaged); restore it from a backup")
        raise PackNotFound(f"no pack with key {key}")

    def _names_in(self, txn: lmdb.Transaction[bytes], key: str) -> tuple[str, ...]:
        """The names pointing at ``key``, sorted (one prefix scan of the key -> names index)."""
        return _names_at(txn.cursor(db=self._key_names), key)

    def _summaries_in(self, txn: lmdb.Transaction[bytes], found: Iterator[tuple[str, bytes]]) -> Iterator[PackSummary]:
        """A summary with its names for each (key, summary record); one cursor reads every key's names."""
        names = txn.cursor(db=self._key_names)
        for key, data in found:
            yield parse_summary(key, _names_at(names, key), data)

    def _stored(self, txn: lmdb.Transaction[bytes], key: str) -> StoredPack:
        header = self._header_in(txn, key)
        size = pack_stored_bytes(header, self._header_json_in(txn, key))
        return StoredPack(header=header, names=self._names_in(txn, key), stored_bytes=size, signatures=self._signatures_in(txn, key))

    def stat(self, ref: str, *, model_fp: str | None = None) -> StoredPack:
        """Header, names and size of one pack, without reading its body."""
        key = self.resolve(ref, model_fp=model_fp)
        with self._env.read() as txn:
            return self._stored(txn, key)

    def list_page(
        self,
        *,
        page_size: int = DEFAULT_PAGE,
        page_token: str = "",
        model_fp: str | None = None,
        template_fp: str | None = None,
        name: str | None = None,
    ) -> PackPage:
        """Summaries of the matching packs after ``page_token``, in key order, at most ``page_size``.

        Reads only summaries and the key -> names index: cost grows with the page, not the store.
        """
        if not 1 <= page_size <= MAX_PAGE:
            raise InvalidInput(f"page size {page_size} is outside 1-{MAX_PAGE}")
        with self._env.read() as txn:
            found = self._summaries_in(txn, self._matching_in(txn, page_token, model_fp, template_fp, name))
            packs = list(itertools.islice(found, page_size + 1))
        if len(packs) > page_size:
            return PackPage(packs=packs[:page_size], next_token=packs[page_size - 1].key)
        return PackPage(packs=packs)

    def _matching_in(
        self, txn: lmdb.Transaction[bytes], after: str, model_fp: str | None, template_fp: str | None, name: str | None
    ) -> Iterator[tuple[str, bytes]]:
        """(key, summary record) of each matching pack whose key sorts after ``after``, in key order."""
        found: Iterator[tuple[str, bytes]]
        if name is not None:
            scope = f"{name}/{model_fp}".encode() if model_fp else f"{name}/".encode()
            keys = sorted({v.decode() for _, v in _prefix_scan(txn, self._by_name, scope)})
            candidates = ((key, txn.get(key.encode(), db=self._summaries)) for key in keys if key > after)
            found = ((key, data) for key, data in candidates if data is not None)
        else:
            prefix = f"{model_fp}/{template_fp}/" if model_fp and template_fp else f"{model_fp}/" if model_fp else ""
            start = max(prefix, after).encode()
            cursor = txn.cursor(db=self._summaries)
            found = (
                (key.decode(), data)
                for key, data in (cursor if cursor.set_range(start) else ())
                if key.decode() > after
            )
            found = itertools.takewhile(lambda item: item[0].startswith(prefix), found)
        for key, data in found:
            if template_fp is None or key.split("/")[1] == template_fp:
                yield key, data

    def list(
        self, *, model_fp: str | None = None, template_fp: str | None = None, name: str | None = None
    ) -> builtins.list[PackSummary]:
        """Every matching pack's summary, in key order (one read transaction)."""
        with self._env.read() as txn:
            return list(self._summaries_in(txn, self._matching_in(txn, "", model_fp, template_fp, name)))

    def counts(self) -> StoreCounts:
        with self._env.read() as txn:
            return self._counts_in(txn)

    def _chunk_in(self, txn: lmdb.Transaction[V], key: str, index: int) -> V:
        """Chunk ``index`` of pack ``key`` as ``txn`` holds it; IntegrityError when it is missing."""
        data = txn.get(_chunk_key(key, index), db=self._chunks)
        if data is None:
            raise IntegrityError(f"pack {key}: chunk {index} is missing")
        return data

    def open_pack(
        self,
        ref: str,
        *,
        model_fp: str | None = None,
        template_fp: str | None = None,
        layers: tuple[int, int] | None = None,
        prefix: int | None = None,
        keep: bool = False,
        signatures: bool = False,
        as_stored: bool = False,
    ) -> OpenedPack:
        """The chunks are read in one read transaction, straight from LMDB's map unless ``keep`` (then copied out),
        after checking that the pack was not deleted or replaced since its header was read."""
        key = self.resolve(ref, model_fp=model_fp)
        with self._env.read() as txn:
            header = self._header_in(txn, key)
            stored_header = txn.get(key.encode(), db=self._packs)
            found = self._signatures_in(txn, key) if signatures else ()
        indices = chunks_for(header, layers, prefix)

        @contextmanager
        def chunks() -> Iterator[Iterator[tuple[int, bytes | memoryview]]]:
            with self._env.read(buffers=not keep) as txn:
                if txn.get(key.encode(), db=self._packs) != stored_header:
                    raise PackNotFound(f"pack {key} was deleted or replaced while it was being read")
                yield ((index, self._chunk_in(txn, key, index)) for index in indices)

        return OpenedPack(header=header, signatures=found, indices=indices, chunks=chunks)

    def read_chunks(self, header: PackHeader, indices: Sequence[int]) -> Iterator[bytes]:
        """Chunks ``indices`` of a pack in order, as stored, each read (in a transaction of its own) only when the
        caller takes it: a stream holds one chunk at a time, not the pack, nor a read transaction."""
        for index in indices:
            with self._env.read() as txn:
                data = txn.get(_chunk_key(header.key, index), db=self._chunks)
            if data is None:
                raise PackNotFound(f"pack {header.key}: chunk {index} is gone (was the pack deleted during the transfer?)")
            yield data

    def begin_upload(self, header: PackHeader) -> LmdbUpload:
        """Start a staged upload: chunks land in ``staging`` one transaction each, then commit atomically."""
        header.validate(encoded=True)
        return LmdbUpload(self, header)

    def begin_stream(self, key: str) -> LmdbStream:
        """Start writing pack ``key`` as it is made (``LmdbStream``): its chunks before its header is known.
        StoreBusy when another stream, in this process or another, is writing the same key."""
        if not parse_key(key):
            raise InvalidInput(f"not a pack key: {key!r}")
        return LmdbStream(self, key)

    def keys(self) -> builtins.list[str]:
        """Every stored key, whether or not its header still parses, and any key the listing index
        holds without a header (only damage causes one), so that verify reports it."""
        with self._env.read() as txn:
            found = {bytes(k) for k, _ in txn.cursor(db=self._packs)} | {bytes(k) for k, _ in txn.cursor(db=self._summaries)}
        return sorted(k.decode(errors="replace") for k in found)

    # -- maintenance -------------------------------------------------------------------------

    def _data_file_bytes(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    def gc(self, *, compact: bool = False) -> GcReport:
        """Remove chunks no header references and names pointing at no pack; optionally compact the file.

        Freed pages are reused by later writes; ``compact`` also returns them to the file system and
        needs the store to itself (no other process may have it open).
        """
        before = self._data_file_bytes()

        def body(txn: lmdb.Transaction[bytes]) -> tuple[int, int, int]:
            cutoff = time.time() - STALE_UPLOAD_SECONDS
            claims = dict(_claims_in(txn, self._staging))  # a stream's chunks are no orphans while its claim is fresh
            stale = [k for k, _ in txn.cursor(db=self._staging) if (claims[k][0] if k in claims else int(k.split(b"-", 1)[0])) < cutoff]
            for k in stale:
                txn.delete(k, db=self._staging)
            live = {k.decode() for k, _ in txn.cursor(db=self._packs)} | {key for when, key in claims.values() if when >= cutoff}
            orphans = [(k, len(v)) for k, v in txn.cursor(db=self._chunks) if _pack_of_chunk(k) not in live]
            dangling = [k.decode().split("/", 1) for k, v in txn.cursor(db=self._names) if v.decode() not in live]
            for k, _ in orphans:
                txn.delete(k, db=self._chunks)
            for model_fp, name in dangling:
                self._unname_in(txn, model_fp, name)
            for k in [k for k, _ in txn.cursor(db=self._signatures) if k.rsplit(b"/", 1)[0].decode() not in live]:
                txn.delete(k, db=self._signatures)
            return len(orphans) + len(stale), sum(size for _, size in orphans), len(dangling)

        orphan_chunks, orphan_bytes, dangling = self._write(body)
        if compact:
            self._compact()
        return GcReport(orphan_chunks, orphan_bytes, dangling, before, self._data_file_bytes(), compact)

    def backup_into(self, directory: Path) -> None:
        """A consistent copy of this store (one read snapshot, free pages dropped) into the empty ``directory``."""
        self._env.copy_to(directory)

    def _compact(self) -> None:
        """Rewrite the data file without free pages, under an exclusive lock, and swap it in atomically."""
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            raise StoreBusy(f"store {self.path} is open in another process; compaction needs it alone") from None
        scratch = self.path / ".compact"
        try:
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            self._env.compact(scratch, reopened=self._open_dbs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            fcntl.flock(self._lock, fcntl.LOCK_SH)


class LmdbUpload:
    """A pack arriving chunk by chunk. Each chunk is verified and staged in its own transaction, so
    memory holds one chunk at a time; ``commit`` moves them into place in one transaction."""

    def __init__(self, store: LmdbStore, header: PackHeader) -> None:
        self.store = store
        self.header = header
        self._id = f"{int(time.time())}-{uuid.uuid4().hex}".encode()
        self._received = 0

    def _staging_key(self, index: int) -> bytes:
        return self._id + b"#" + struct.pack(">I", index)

    def add_chunk(self, index: int, data: bytes) -> None:
        if index != self._received:
            raise InvalidInput(f"chunk {index} arrived out of order; expected chunk {self._received}")
        if index >= len(self.header.chunks):
            raise InvalidInput(f"chunk {index} is beyond the {len(self.header.chunks)} chunks the header lists")
        verify_chunk(self.header, index, data)
        self.store._write(lambda txn: txn.put(self._staging_key(index), data, db=self.store._staging))
        self._received += 1

    def commit(self, *, name: str | None = None, signatures: tuple[Signature, ...] = ()) -> tuple[str, bool]:
        """Store the pack atomically (idempotent by key), with any signatures (checked against its
        digest), and drop the staged chunks."""
        if self._received != len(self.header.chunks):
            raise InvalidInput(f"upload ended after {self._received} of {len(self.header.chunks)} chunks")
        if name is not None:
            check_name(name)
        EncodedPack(self.header, [], tuple(signatures)).check_signatures()
        store = self.store

        def body(txn: lmdb.Transaction[bytes]) -> bool:
            def staged(index: int) -> bytes:
                data = txn.get(self._staging_key(index), db=store._staging)
                if data is None:  # a gc removed the staged chunks of an upload older than STALE_UPLOAD_SECONDS
                    raise Unavailable(f"pack {self.header.key}: staged chunk {index} was removed by a gc; upload the pack again")
                return data

            created = store._commit_in(txn, self.header, staged, name, signatures)
            for index in range(self._received):
                txn.delete(self._staging_key(index), db=store._staging)
            return created

        return self.header.key, store._write(body)

    def abort(self) -> None:
        """Drop whatever was staged (an unfinished upload leaves nothing behind)."""
        received, self._received = self._received, 0
        self.store._write(lambda txn: [txn.delete(self._staging_key(i), db=self.store._staging) for i in range(received)])


class LmdbStream:
    """A pack written while it is made (``LmdbStore.begin_stream``; ``answering.building`` encodes a pack as its prefill
    runs): its chunks come in any order, each checked against its own record (``ChunkInfo``, as ``put`` checks every
    chunk) and written under its final key in a transaction of about ``STREAM_BATCH_BYTES`` with others (memory holds
    one batch, never the pack, and the disk works while the pack is still being made); ``commit`` writes the rest and
    the header in one transaction, so the pack is listed, read or named whole or not at all. ``add`` may be called from
    several threads.

    Meanwhile the stream claims the key (a record in ``staging``, refreshed with each batch): ``gc`` leaves the chunks
    of a freshly claimed key alone, and a second stream of the same key is refused (StoreBusy). A ``put`` or an upload
    of the same pack may still come first: every batch and the commit look for the header in their own transaction,
    and once it is there the stream writes nothing more (its commit returns created False). ``abort`` removes what it
    wrote; a process that dies mid-stream leaves chunks no header lists, which ``gc`` removes once the claim is
    ``STALE_UPLOAD_SECONDS`` old. ``seconds``: time spent checking chunks (``digest``) and writing them as they came
    (``write``; the commit's own is not counted).
    ``stored``: the pack is stored already (by another writer), so nothing more is written."""

    def __init__(self, store: LmdbStore, key: str) -> None:
        self.store, self.key = store, key
        self.seconds = {"digest": 0.0, "write": 0.0}
        self._claim = f"{int(time.time())}-{uuid.uuid4().hex}".encode() + CLAIM
        self._records: dict[int, ChunkInfo] = {}
        self._written: set[int] = set()
        self._batch: list[tuple[int, bytes]] = []
        self._batch_bytes = 0
        self._lock = threading.Lock()  # the records, the batch and the seconds
        self._writing = threading.Lock()  # one write of this stream at a time
        self._open = True
        self.stored = store._write(self._claim_in)

    def _claim_in(self, txn: lmdb.Transaction[bytes]) -> bool:
        """Claim the key unless the pack is stored (True) or another stream claims it freshly (StoreBusy)."""
        store = self.store
        if txn.get(self.key.encode(), db=store._packs) is not None:
            return True
        cutoff = time.time() - STALE_UPLOAD_SECONDS
        if any(key == self.key and when >= cutoff for _, (when, key) in _claims_in(txn, store._staging)):
            raise StoreBusy(f"pack {self.key} is being written by another build; try again when it is done")
        txn.put(self._claim, _claim_value(self.key), db=store._staging)
        return False

    def add(self, index: int, data: bytes, info: ChunkInfo) -> None:
        """Chunk ``index``, its bytes and its record: checked against each other, then written with the next batch."""
        started = time.perf_counter()
        verify_chunk_info(self.key, index, info, data)
        checked = time.perf_counter()
        with self._lock:
            if not self._open:
                raise InvalidInput(f"pack {self.key}: the stream is closed")
            if index < 0 or index in self._records:
                raise InvalidInput(f"pack {self.key}: chunk {index} came {'twice' if index >= 0 else 'with a negative index'}")
            self._records[index] = info
            self.seconds["digest"] += checked - started
            if self.stored:
                return
            self._batch.append((index, data))
            self._batch_bytes += len(data)
            if self._batch_bytes < STREAM_BATCH_BYTES:
                return
            batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._write(batch)

    def _write(self, batch: list[tuple[int, bytes]]) -> None:
        started = time.perf_counter()
        with self._writing:
            stored = self.store._write(lambda txn: self._write_in(txn, batch))
        with self._lock:
            self.seconds["write"] += time.perf_counter() - started
            if stored:
                self.stored = True
            else:
                self._written.update(index for index, _ in batch)

    def _write_in(self, txn: lmdb.Transaction[bytes], batch: list[tuple[int, bytes]]) -> bool:
        """Write ``batch`` and refresh the claim, unless the pack is stored by now (True: then nothing)."""
        store = self.store
        if txn.get(self.key.encode(), db=store._packs) is not None:
            return True
        for index, data in batch:
            txn.put(_chunk_key(self.key, index), data, db=store._chunks)
        txn.put(self._claim, _claim_value(self.key), db=store._staging)
        return False

    def commit(self, header: PackHeader, *, name: str | None = None, signatures: tuple[Signature, ...] = ()) -> tuple[str, bool]:
        """Store the pack whose header is ``header`` (every chunk it lists added, each matching its record there), with
        the chunks not yet written, its name and any signatures, in one transaction; returns ``(key, created)``."""
        header.validate(encoded=True)
        if header.key != self.key:
            raise InvalidInput(f"the stream writes pack {self.key}, not {header.key}")
        if name is not None:
            check_name(name)
        EncodedPack(header, [], tuple(signatures)).check_signatures()
        with self._lock:
            records = [self._records.get(index) for index in range(len(header.chunks))]
            if len(self._records) != len(header.chunks) or records != list(header.chunks):
                raise InvalidInput(f"pack {self.key}: the chunks added are not those its header lists")
            self._open = False
            batch, self._batch = self._batch, []
        store = self.store

        def body(txn: lmdb.Transaction[bytes]) -> bool:
            if txn.get(self.key.encode(), db=store._packs) is None:
                for index, data in batch:
                    txn.put(_chunk_key(self.key, index), data, db=store._chunks)
                cursor = txn.cursor(db=store._chunks)
                for index in range(len(header.chunks)):
                    if not cursor.set_key(_chunk_key(self.key, index)):
                        raise Unavailable(f"pack {self.key}: chunk {index}, written while it was made, is gone; build it again")
            created = store._commit_in(txn, header, None, name, signatures)
            txn.delete(self._claim, db=store._staging)
            return created

        with self._writing:
            created = store._write(body)
        return self.key, created

    def abort(self) -> None:
        """Remove the chunks written and the claim (unless the pack was stored meanwhile: they are its own then)."""
        with self._lock:
            self._open = False
            self._batch = []
        store = self.store

        def body(txn: lmdb.Transaction[bytes]) -> None:
            if txn.get(self.key.encode(), db=store._packs) is None:
                for index in sorted(self._written):
                    txn.delete(_chunk_key(self.key, index), db=store._chunks)
            txn.delete(self._claim, db=store._staging)

        with self._writing:
            store._write(body)
if TYPE_CHECKING:  # mypy proves the tier is each interface its users take it as (isinstance checks only at run time)
    _served: type[ServedStore] = LmdbStore
    _migrated: type[BankRecords] = LmdbStore
    _backed_up: type[BacksUp] = LmdbStore
