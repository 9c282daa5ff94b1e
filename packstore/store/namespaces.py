"""One embedded store per namespace, so tenants' keys, names and banks never meet.

``default`` is the data directory itself (the store a service without tokens serves, so a store
written before namespaces existed is the ``default`` namespace); any other namespace ``N`` is the
store in ``DATA/namespaces/N``, created on first use. Two namespaces holding the same content hold
two packs, each with its own records, sizes and times.
"""

from __future__ import annotations

import threading
from pathlib import Path

import os
import shutil
from dataclasses import dataclass

from packstore.errors import InvalidInput
from packstore.store.lmdb_store import LmdbStore
from packstore.store.protocol import check_name

NAMESPACES_DIR = "namespaces"
DEFAULT_NAMESPACE = "default"


def namespace_path(data: str | Path, namespace: str) -> Path:
    """Where namespace ``namespace`` of the data directory ``data`` lives."""
    return Path(data) if namespace == DEFAULT_NAMESPACE else Path(data) / NAMESPACES_DIR / check_name(namespace)


class NamespaceStores:
    """The stores of a data directory, one per namespace, opened when first used and kept open."""

    def __init__(self, data: str | Path, *, max_bytes: int | None = None) -> None:
        """``max_bytes``: each namespace's store may hold at most this (a per-tenant quota); None: no limit."""
        self.data = Path(data)
        self.max_bytes = max_bytes
        self._stores: dict[str, LmdbStore] = {}
        self._lock = threading.Lock()
        self.get(DEFAULT_NAMESPACE)

    def get(self, namespace: str) -> LmdbStore:
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = LmdbStore(namespace_path(self.data, namespace), max_bytes=self.max_bytes)
            return store

    def opened(self) -> dict[str, LmdbStore]:
        with self._lock:
            return dict(self._stores)

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
