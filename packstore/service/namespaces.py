"""One embedded store per namespace, so tenants' keys, names and banks never meet.

``default`` is the data directory itself (the store a service without tokens serves, so a store
written before namespaces existed is the ``default`` namespace); any other namespace ``N`` is the
store in ``DATA/namespaces/N``, created on first use. Two namespaces holding the same content hold
two packs, each with its own records, sizes and times.
"""

from __future__ import annotations

import threading
from pathlib import Path

from packstore.service.auth import DEFAULT_NAMESPACE
from packstore.store import LmdbStore
from packstore.store.protocol import check_name

NAMESPACES_DIR = "namespaces"


def namespace_path(data: str | Path, namespace: str) -> Path:
    """Where namespace ``namespace`` of the data directory ``data`` lives."""
    return Path(data) if namespace == DEFAULT_NAMESPACE else Path(data) / NAMESPACES_DIR / check_name(namespace)


class NamespaceStores:
    """The stores of a data directory, one per namespace, opened when first used and kept open."""

    def __init__(self, data: str | Path) -> None:
        self.data = Path(data)
        self._stores: dict[str, LmdbStore] = {}
        self._lock = threading.Lock()
        self.get(DEFAULT_NAMESPACE)

    def get(self, namespace: str) -> LmdbStore:
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = LmdbStore(namespace_path(self.data, namespace))
            return store

    def opened(self) -> dict[str, LmdbStore]:
        with self._lock:
            return dict(self._stores)

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
