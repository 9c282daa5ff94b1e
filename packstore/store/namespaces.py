"""One store per namespace, so tenants' keys, names and banks never meet.

Embedded: ``default`` is the data directory itself (the store a service without tokens serves, so a
store written before namespaces existed is the ``default`` namespace); any other namespace ``N`` is
the store in ``DATA/namespaces/N``, created by the first write to it. On an object store (``objects``),
each namespace is its tree of the bucket and the data directory holds only each one's bounded cache, in
``DATA/object-cache/N``. Two namespaces holding the same content hold two packs, each with its own
records, sizes and times. A read never creates a namespace: one without a store (no data file; on an
object store, no object in its tree) is read as an empty store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from packstore.errors import InvalidInput
from packstore.store.lmdb.store import LmdbStore
from packstore.store.objects.cache import DEFAULT_CACHE_BYTES
from packstore.store.protocol import DEFAULT_NAMESPACE, ServedStore, check_name

NAMESPACES_DIR = "namespaces"
CACHES_DIR = "object-cache"
EMPTY_MAP_BYTES = 1 << 20  # the empty store's map: it is never written


def namespace_path(data: str | Path, namespace: str) -> Path:
    """Where namespace ``namespace`` of the data directory ``data`` lives."""
    return Path(data) if namespace == DEFAULT_NAMESPACE else Path(data) / NAMESPACES_DIR / check_name(namespace)


def empty_store(directory: str | Path) -> LmdbStore:
    """A store with nothing in it, made in ``directory`` and opened read-only: what a namespace without a store reads
    as, answering every read exactly as an empty namespace does (the same NOT_FOUND for any pack or bank)."""
    LmdbStore(directory, map_size=EMPTY_MAP_BYTES).close()
    return LmdbStore(directory, readonly=True, map_size=EMPTY_MAP_BYTES)


class NamespaceStores:
    """The stores of a data directory (or of an object store, cached there), one per namespace, opened
    when first used and kept open; the ``default`` one is opened at once, so a store that cannot be
    reached fails at start. ``get`` (for writes) creates a namespace's store; ``for_reading`` never does."""

    def __init__(
        self,
        data: str | Path,
        *,
        max_bytes: int | None = None,
        objects: str | None = None,
        endpoint: str | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """``max_bytes``: each embedded namespace's store may hold at most this (a per-tenant quota); None: no limit.
        ``objects``: ``s3://BUCKET/PREFIX`` to serve from, at ``endpoint``, each namespace caching ``cache_bytes``."""
        self.data = Path(data)
        self.max_bytes = max_bytes
        self.objects, self.endpoint, self.cache_bytes = objects, endpoint, cache_bytes
        self._stores: dict[str, ServedStore] = {}
        self._lock = threading.Lock()
        self._scratch = tempfile.TemporaryDirectory(prefix="packstore-empty-")
        self._empty = empty_store(self._scratch.name)
        self.get(DEFAULT_NAMESPACE)

    def _open(self, namespace: str) -> ServedStore:
        if self.objects is None:
            return LmdbStore(namespace_path(self.data, namespace), max_bytes=self.max_bytes)
        from packstore.store.objects.store import ObjectStore

        cache = self.data / CACHES_DIR / check_name(namespace)
        return ObjectStore(self.objects, endpoint=self.endpoint, cache_dir=cache, cache_bytes=self.cache_bytes, namespace=namespace)

    def get(self, namespace: str) -> ServedStore:
        """The namespace's store, created if it has none (a write, or an admin action)."""
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = self._open(namespace)
            return store

    def for_reading(self, namespace: str) -> ServedStore:
        """The namespace's store if it has one, else the read-only empty store: a read creates nothing (no
        directory, data file or cache), so a token may name any number of namespaces without making one."""
        with self._lock:
            store = self._stores.get(namespace)
        if store is not None:
            return store
        return self.get(namespace) if self._exists(namespace) else self._empty

    def _exists(self, namespace: str) -> bool:
        """Whether the namespace has a store to open without creating one: its data file, or on an object store
        any object in its tree of the bucket (another replica may have written it)."""
        if self.objects is None:
            return (namespace_path(self.data, namespace) / "data.mdb").exists()
        from packstore.store.objects.store import ObjectStore

        store = self.get(DEFAULT_NAMESPACE)
        assert isinstance(store, ObjectStore)  # _open makes object stores when self.objects is set
        return store.holds_namespace(namespace)

    def opened(self) -> dict[str, ServedStore]:
        with self._lock:
            return dict(self._stores)

    def local_file_bytes(self) -> int:
        """Bytes of the local files of the open stores: the embedded stores, or the object stores' caches."""
        stores = self.opened()
        if self.objects is None:
            return sum((namespace_path(self.data, ns) / "data.mdb").stat().st_size for ns in stores)
        return sum((self.data / CACHES_DIR / ns / "data.mdb").stat().st_size for ns in stores)

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            self._empty.close()
            self._scratch.cleanup()


def namespaces_at(data: str | Path) -> list[str]:
    """The namespaces a data directory holds a store for, ``default`` first."""
    found = [DEFAULT_NAMESPACE] if (Path(data) / "data.mdb").exists() else []
    others = Path(data) / NAMESPACES_DIR
    if others.is_dir():
        found += sorted(entry.name for entry in others.iterdir() if (entry / "data.mdb").exists())
    return found


@dataclass(frozen=True)
class BackupReport:
    """What a backup copied: per namespace, its packs and stored bytes, and the copy's size on disk."""

    destination: str
    namespaces: dict[str, dict[str, int]]


def backup(data: str | Path, destination: str | Path) -> BackupReport:
    """A consistent hot copy of the store at ``data``, and of each of its namespaces, into ``destination``
    (which must not exist): each store is copied from one read snapshot of it (so every pack in the
    copy is complete, and every pack committed before the copy began is in it) while writers go on;
    the copy is written beside ``destination`` and renamed into place only when whole. The copy is a
    store: restore by pointing ``--data``/``--store`` at it, or by putting it in the original's place."""
    source, target = Path(data), Path(destination)
    if target.exists():
        raise InvalidInput(f"backup destination {target} exists: give a new path")
    namespaces = namespaces_at(source)
    if not namespaces:
        raise InvalidInput(f"no pack store at {source}")
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    copied: dict[str, dict[str, int]] = {}
    try:
        for namespace in namespaces:
            into = namespace_path(partial, namespace)
            into.mkdir(parents=True)
            with LmdbStore(namespace_path(source, namespace), readonly=True) as store:
                store.backup_into(into)
            with LmdbStore(into, readonly=True) as copy:
                counts = copy.counts()
            file_bytes = (into / "data.mdb").stat().st_size
            copied[namespace] = {"packs": counts.packs, "stored_bytes": counts.stored_bytes, "file_bytes": file_bytes}
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return BackupReport(str(target), copied)
