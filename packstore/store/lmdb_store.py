"""LMDB-backed pack store: headers, chunks and names written in one transaction per put."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import lmdb

from packstore.errors import AmbiguousRef, IntegrityError, InvalidInput, PackNotFound, StoreBusy
from packstore.format import EncodedPack, Pack, PackHeader, decode_pack, parse_key
from packstore.format.body import verify_chunk
from packstore.store.banks import BankTables

STORE_LAYOUT_VERSION = b"1"
LOCK_FILE = "packstore.lock"
INITIAL_MAP_SIZE = 1 << 30
STALE_UPLOAD_SECONDS = 3600
_HASH_PREFIX_RE = re.compile(r"^[0-9a-f]{8,64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
T = TypeVar("T")


def default_store_path() -> Path:
    """``$PACKSTORE_STORE``, else ``$XDG_DATA_HOME/packstore``, else ``~/.local/share/packstore``."""
    if os.environ.get("PACKSTORE_STORE"):
        return Path(os.environ["PACKSTORE_STORE"])
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "packstore"


def check_name(name: str) -> str:
    """Names are 1-128 characters of letters, digits and ``._:@+-``, starting alphanumeric."""
    if not _NAME_RE.match(name):
        raise InvalidInput(
            f"invalid pack name {name!r}: use 1-128 letters, digits or ._:@+- , starting with a letter or digit"
        )
    return name


def _chunk_key(key: str, index: int) -> bytes:
    return key.encode() + b"#" + struct.pack(">I", index)


def _name_key(model_fp: str, name: str) -> bytes:
    return f"{model_fp}/{name}".encode()


@dataclass(frozen=True)
class VerifyResult:
    """One pack's integrity check: ``error`` is None when every byte checked out."""

    key: str
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed, and the data file size before and after (compaction shrinks it)."""

    orphan_chunks: int
    orphan_chunk_bytes: int
    dangling_names: int
    file_bytes_before: int
    file_bytes_after: int
    compacted: bool


@dataclass(frozen=True)
class StoredPack:
    """A stored pack's header, the names that point at it, and its size on disk."""

    header: PackHeader
    names: tuple[str, ...]
    stored_bytes: int

    @property
    def key(self) -> str:
        return self.header.key


class PackStore(BankTables):
    """A directory holding one LMDB environment with databases ``meta``, ``packs``, ``chunks``, ``names``.

    Every write is one LMDB write transaction, so a pack is either fully present or absent.
    """

    def __init__(self, path: str | os.PathLike[str], *, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        if readonly and not (self.path / "data.mdb").exists():
            raise PackNotFound(f"no pack store at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        # Every open holds a shared advisory lock; compaction, which swaps the data file, needs it exclusive.
        self._lock = open(self.path / LOCK_FILE, "rb" if readonly and (self.path / LOCK_FILE).exists() else "a+b")
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        self._open_env()

    def _open_env(self) -> None:
        readonly = self.readonly
        self._env = lmdb.open(str(self.path), map_size=INITIAL_MAP_SIZE, max_dbs=8, readonly=readonly, subdir=True)
        self._meta = self._env.open_db(b"meta", create=not readonly)
        self._packs = self._env.open_db(b"packs", create=not readonly)
        self._chunks = self._env.open_db(b"chunks", create=not readonly)
        self._names = self._env.open_db(b"names", create=not readonly)
        self._staging = self._env.open_db(b"staging", create=not readonly) if not readonly else None
        self._banks = self._env.open_db(b"banks", create=not readonly) if not readonly or self._has_db(b"banks") else None
        if not readonly:
            self._write(lambda txn: txn.put(b"layout", STORE_LAYOUT_VERSION, db=self._meta, overwrite=False))
        with self._env.begin() as txn:
            layout = txn.get(b"layout", db=self._meta)
        if layout is not None and layout != STORE_LAYOUT_VERSION:
            raise IntegrityError(f"store {self.path} has layout {layout!r}, this build reads {STORE_LAYOUT_VERSION!r}")

    def _has_db(self, name: bytes) -> bool:
        with self._env.begin() as txn:
            return txn.get(name) is not None

    def close(self) -> None:
        self._env.close()
        self._lock.close()

    def __enter__(self) -> "PackStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, body: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``body`` in one write transaction, doubling the map and retrying when it is full."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)

    # -- writes ---------------------------------------------------------------------------

    def put(self, encoded: EncodedPack, *, name: str | None = None) -> tuple[str, bool]:
        """Store a pack (and optionally name it). Returns ``(key, created)``; same content is stored once."""
        header = encoded.header
        header.validate()
        if len(encoded.chunks) != len(header.chunks):
            raise InvalidInput(f"pack has {len(encoded.chunks)} chunks, header lists {len(header.chunks)}")
        for index, data in enumerate(encoded.chunks):
            verify_chunk(header, index, data)
        if name is not None:
            check_name(name)
        return header.key, self._write(lambda txn: self._commit_in(txn, header, encoded.chunks.__getitem__, name))

    def _commit_in(
        self, txn: lmdb.Transaction, header: PackHeader, chunk: Callable[[int], bytes], name: str | None
    ) -> bool:
        """Write chunks (``chunk(i)`` gives chunk i), header and name unless the key is stored; True if new."""
        key = header.key
        created = txn.get(key.encode(), db=self._packs) is None
        if created:
            for index in range(len(header.chunks)):
                txn.put(_chunk_key(key, index), chunk(index), db=self._chunks)
            txn.put(key.encode(), header.to_json(), db=self._packs)
        if name is not None:
            txn.put(_name_key(header.model_fp, name), key.encode(), db=self._names)
        return created

    def set_name(self, ref: str, name: str, *, model_fp: str | None = None) -> str:
        """Point ``name`` at the pack ``ref`` (within the pack's model); returns the key."""
        check_name(name)
        key = self.resolve(ref, model_fp=model_fp)
        model = parse_key(key)[0]  # type: ignore[index]
        self._write(lambda txn: txn.put(_name_key(model, name), key.encode(), db=self._names))
        return key

    def delete_name(self, name: str, *, model_fp: str) -> str:
        """Remove one name of one model (the pack stays); returns the key it pointed at."""

        def body(txn: lmdb.Transaction) -> str:
            found = txn.pop(_name_key(model_fp, name), db=self._names)
            if found is None:
                raise PackNotFound(f"no pack named {name!r} for model {model_fp[:12]}")
            return found.decode()

        return self._write(body)

    def delete(self, ref: str, *, model_fp: str | None = None) -> str:
        """Remove a pack, its chunks and every name pointing at it, in one transaction; returns the key."""
        key = self.resolve(ref, model_fp=model_fp)

        def body(txn: lmdb.Transaction) -> None:
            header = self._header_in(txn, key)
            for index in range(len(header.chunks)):
                txn.delete(_chunk_key(key, index), db=self._chunks)
            txn.delete(key.encode(), db=self._packs)
            for name_key in self._name_keys_in(txn, key):
                txn.delete(name_key, db=self._names)

        self._write(body)
        return key

    # -- reads ----------------------------------------------------------------------------

    def resolve(self, ref: str, *, model_fp: str | None = None) -> str:
        """Turn a REF into a stored key: a full key, a name, or a unique prefix (8+ hex) of a content hash.

        Names and prefixes are looked up among ``model_fp``'s packs when it is given.
        """
        with self._env.begin() as txn:
            if parse_key(ref):
                if txn.get(ref.encode(), db=self._packs) is None:
                    raise PackNotFound(f"no pack with key {ref}")
                return ref
            if model_fp is not None:
                found = txn.get(_name_key(model_fp, ref), db=self._names)
                matches = [found.decode()] if found is not None else []
            else:
                matches = [v.decode() for k, v in txn.cursor(db=self._names) if k.decode().split("/", 1)[1] == ref]
            if not matches and _HASH_PREFIX_RE.match(ref):
                matches = [
                    key
                    for key in (k.decode() for k, _ in txn.cursor(db=self._packs))
                    if key.rsplit("/", 1)[1].startswith(ref) and (model_fp is None or key.startswith(model_fp))
                ]
        if not matches:
            scope = f" for model {model_fp[:12]}" if model_fp else ""
            raise PackNotFound(f"no pack named {ref!r}{scope}")
        if len(set(matches)) > 1:
            raise AmbiguousRef(f"name {ref!r} exists for {len(set(matches))} models; use the full key (see packctl ls) or pass --model")
        return matches[0]

    def _header_in(self, txn: lmdb.Transaction, key: str) -> PackHeader:
        data = txn.get(key.encode(), db=self._packs)
        if data is None:
            raise PackNotFound(f"no pack with key {key}")
        header = PackHeader.from_json(data)
        if header.key != key:
            raise IntegrityError(f"pack {key}: stored header describes a different key")
        return header

    def _name_keys_in(self, txn: lmdb.Transaction, key: str) -> list[bytes]:
        return [k for k, v in txn.cursor(db=self._names) if v.decode() == key]

    def _stored(self, txn: lmdb.Transaction, key: str) -> StoredPack:
        header = self._header_in(txn, key)
        names = tuple(sorted(k.decode().split("/", 1)[1] for k in self._name_keys_in(txn, key)))
        stored = len(txn.get(key.encode(), db=self._packs)) + sum(c.stored_bytes for c in header.chunks)
        return StoredPack(header=header, names=names, stored_bytes=stored)

    def stat(self, ref: str, *, model_fp: str | None = None) -> StoredPack:
        """Header, names and size of one pack, without reading its body."""
        key = self.resolve(ref, model_fp=model_fp)
        with self._env.begin() as txn:
            return self._stored(txn, key)

    def list(self, *, model_fp: str | None = None) -> list[StoredPack]:
        """Every stored pack (optionally of one model), in key order."""
        with self._env.begin() as txn:
            keys = [k.decode() for k, _ in txn.cursor(db=self._packs)]
            packs = [self._stored(txn, key) for key in keys]
        return [p for p in packs if model_fp is None or p.header.model_fp == model_fp]

    def _read(self, ref: str, *, model_fp: str | None = None) -> EncodedPack:
        """A pack's header and chunks as stored, not yet checked against their checksums."""
        key = self.resolve(ref, model_fp=model_fp)
        with self._env.begin(buffers=False) as txn:
            header = self._header_in(txn, key)
            chunks = []
            for index in range(len(header.chunks)):
                data = txn.get(_chunk_key(key, index), db=self._chunks)
                if data is None:
                    raise IntegrityError(f"pack {key}: chunk {index} is missing")
                chunks.append(data)
        return EncodedPack(header=header, chunks=chunks)

    def get(self, ref: str, *, model_fp: str | None = None) -> EncodedPack:
        """Read a pack's header and every chunk, verifying each chunk's checksum."""
        encoded = self._read(ref, model_fp=model_fp)
        for index, data in enumerate(encoded.chunks):
            verify_chunk(encoded.header, index, data)
        return encoded

    def fetch(
        self, ref: str, *, device: str | None = None, model_fp: str | None = None, template_fp: str | None = None
    ) -> Pack:
        """Get, verify and decode a pack; refuses one whose identities differ from those the caller states."""
        encoded = self._read(ref, model_fp=model_fp)
        encoded.header.check_identities(model_fp, template_fp)
        pack = decode_pack(encoded)  # verifies every chunk's checksum before decoding it
        if device is not None and str(device) != "cpu":
            pack = Pack(header=pack.header, keys=[k.to(device) for k in pack.keys], values=[v.to(device) for v in pack.values])
        return pack

    def read_chunk(self, header: PackHeader, index: int) -> bytes:
        """One stored chunk of a pack, checked against its sha256 (for streaming without the whole pack)."""
        with self._env.begin() as txn:
            data = txn.get(_chunk_key(header.key, index), db=self._chunks)
        if data is None:
            raise PackNotFound(f"pack {header.key}: chunk {index} is gone (was the pack deleted during the transfer?)")
        verify_chunk(header, index, data)
        return data

    def begin_upload(self, header: PackHeader) -> "Upload":
        """Start a staged upload: chunks land in ``staging`` one transaction each, then commit atomically."""
        header.validate()
        return Upload(self, header)

    def keys(self) -> list[str]:
        """Every stored key, whether or not its header still parses."""
        with self._env.begin() as txn:
            return [k.decode() for k, _ in txn.cursor(db=self._packs)]

    # -- integrity and maintenance ---------------------------------------------------------

    def verify(self, ref: str) -> VerifyResult:
        """Check one pack's header seal, every chunk's checksum, and that every chunk decodes."""
        key = ref if parse_key(ref) else self.resolve(ref)
        try:
            decode_pack(self._read(key))  # checks every checksum, then that every chunk decodes
        except (IntegrityError, PackNotFound) as exc:
            return VerifyResult(key=key, error=str(exc))
        return VerifyResult(key=key, error=None)

    def verify_all(self) -> list[VerifyResult]:
        return [self.verify(key) for key in self.keys()]

    def _data_file_bytes(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    def gc(self, *, compact: bool = False) -> GcReport:
        """Remove chunks no header references and names pointing at no pack; optionally compact the file.

        Freed pages are reused by later writes; ``compact`` also returns them to the file system and
        needs the store to itself (no other process may have it open).
        """
        before = self._data_file_bytes()

        def body(txn: lmdb.Transaction) -> tuple[int, int, int]:
            cutoff = time.time() - STALE_UPLOAD_SECONDS
            stale = [k for k, _ in txn.cursor(db=self._staging) if int(k.split(b"-", 1)[0]) < cutoff]
            for k in stale:
                txn.delete(k, db=self._staging)
            live = {k.decode() for k, _ in txn.cursor(db=self._packs)}
            orphans = [(k, len(v)) for k, v in txn.cursor(db=self._chunks) if k.rsplit(b"#", 1)[0].decode() not in live]
            dangling = [k for k, v in txn.cursor(db=self._names) if v.decode() not in live]
            for k, _ in orphans:
                txn.delete(k, db=self._chunks)
            for k in dangling:
                txn.delete(k, db=self._names)
            return len(orphans) + len(stale), sum(size for _, size in orphans), len(dangling)

        orphan_chunks, orphan_bytes, dangling = self._write(body)
        if compact:
            self._compact()
        return GcReport(orphan_chunks, orphan_bytes, dangling, before, self._data_file_bytes(), compact)

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
            self._env.copy(str(scratch), compact=True)
            self._env.close()
            try:
                os.replace(scratch / "data.mdb", self.path / "data.mdb")
            finally:
                self._open_env()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            fcntl.flock(self._lock, fcntl.LOCK_SH)


class Upload:
    """A pack arriving chunk by chunk. Each chunk is verified and staged in its own transaction, so
    memory holds one chunk at a time; ``commit`` moves them into place in one transaction."""

    def __init__(self, store: PackStore, header: PackHeader) -> None:
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

    def commit(self, *, name: str | None = None) -> tuple[str, bool]:
        """Store the pack atomically (idempotent by key) and drop the staged chunks."""
        if self._received != len(self.header.chunks):
            raise InvalidInput(f"upload ended after {self._received} of {len(self.header.chunks)} chunks")
        if name is not None:
            check_name(name)
        store = self.store

        def body(txn: lmdb.Transaction) -> bool:
            created = store._commit_in(txn, self.header, lambda i: txn.get(self._staging_key(i), db=store._staging), name)
            for index in range(self._received):
                txn.delete(self._staging_key(index), db=store._staging)
            return created

        return self.header.key, store._write(body)

    def abort(self) -> None:
        """Drop whatever was staged (an unfinished upload leaves nothing behind)."""
        received, self._received = self._received, 0
        self.store._write(lambda txn: [txn.delete(self._staging_key(i), db=self.store._staging) for i in range(received)])
