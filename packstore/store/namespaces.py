"""One store per namespace, so tenants' keys, names and banks never meet.

Embedded: ``default`` is the data directory itself (the store a service without tokens serves, so a
store written before namespaces existed is the ``default`` namespace); any other namespace ``N`` is
the store in ``DATA/namespaces/N``, created on first use. On an object store (``objects``), each
namespace is its tree of the bucket and the data directory holds only each one's bounded cache, in
``DATA/object-cache/N``. Two namespaces holding the same content hold two packs, each with its own
records, sizes and times.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from packstore.errors import InvalidInput
from packstore.store.lmdb_store import LmdbStore
from packstore.store.object_cache import DEFAULT_CACHE_BYTES
from packstore.store.protocol import PackStore, check_name

NAMESPACES_DIR = "namespaces"
CACHES_DIR = "object-cache"
DEFAULT_NAMESPACE = "default"


def namespace_path(data: str | Path, namespace: str) -> Path:
    """Where namespace ``namespace`` of the data directory ``data`` lives."""
    return Path(data) if namespace == DEFAULT_NAMESPACE else Path(data) / NAMESPACES_DIR / check_name(namespace)


class NamespaceStores:
    """The stores of a data directory (or of an object store, cached there), one per namespace, opened
    when first used and kept open; the ``default`` one is opened at once, so a store that cannot be
    reached fails at start."""

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
        self._stores: dict[str, PackStore] = {}
        self._lock = threading.Lock()
        self.get(DEFAULT_NAMESPACE)

    def _open(self, namespace: str) -> PackStore:
        if self.objects is None:
            return LmdbStore(namespace_path(self.data, namespace), max_bytes=self.max_bytes)
        from packstore.store.s3 import ObjectStore

        cache = self.data / CACHES_DIR / check_name(namespace)
        return ObjectStore(self.objects, endpoint=self.endpoint, cache_dir=cache, cache_bytes=self.cache_bytes, namespace=namespace)

    def get(self, namespace: str) -> PackStore:
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = self._open(namespace)
            return store

    def opened(self) -> dict[str, PackStore]:
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
            copied[namespace] = {"packs": counts.packs, "stored_bytes": counts.stored_bytes, "file_bytes": (into / "data.mdb").stat().st_size}
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return BackupReport(str(target), copied)
