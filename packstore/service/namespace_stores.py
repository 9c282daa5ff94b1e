"""The stores a service serves, one per namespace, so tenants' keys, names and banks never meet.

Embedded: each namespace is its store in the data directory (``store.namespaces.namespace_path``), created by the
first write to it. On an object store (``objects``), each namespace is its tree of the bucket and the data directory
holds only each one's bounded cache, in ``DATA/object-cache/N``. Two namespaces holding the same content hold two
packs, each with its own records, sizes and times. A read never creates a namespace: one without a store (no data
file; on an object store, no object in its tree) is read as an empty store.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from packstore.errors import InvalidInput
from packstore.store import StoreSpec, open_store
from packstore.store.namespaces import DEFAULT_NAMESPACE, namespace_path
from packstore.store.protocol import HoldsNamespaces, ServedStore, check_name
from packstore.store.spec import DEFAULT_OBJECT_CACHE_BYTES

CACHES_DIR = "object-cache"
EMPTY_MAP_BYTES = 1 << 20  # the empty store's map: it is never written


def _served(spec: StoreSpec, *, readonly: bool = False) -> ServedStore:
    store = open_store(spec, readonly=readonly)
    if not isinstance(store, ServedStore):
        store.close()
        raise InvalidInput(f"{spec.location} cannot be served: serve a directory or an s3:// store")
    return store


def empty_store(directory: str | Path) -> ServedStore:
    """A store with nothing in it, made in ``directory`` and opened read-only: what a namespace without a store reads
    as, answering every read exactly as an empty namespace does (the same NOT_FOUND for any pack or bank)."""
    spec = StoreSpec(str(directory), map_size=EMPTY_MAP_BYTES)
    _served(spec).close()
    return _served(spec, readonly=True)


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
        cache_bytes: int = DEFAULT_OBJECT_CACHE_BYTES,
    ) -> None:
        """``max_bytes``: each embedded namespace's store may hold at most this (a per-tenant quota); None: no limit.
        ``objects``: ``s3://BUCKET/PREFIX`` to serve from, at ``endpoint``, each namespace caching ``cache_bytes``."""
        self.data = Path(data)
        self.max_bytes = max_bytes
        self.objects = objects
        self._bucket = StoreSpec(objects, s3_endpoint=endpoint) if objects is not None else None
        self.cache_bytes = cache_bytes
        self._stores: dict[str, ServedStore] = {}
        self._lock = threading.Lock()
        self._scratch = tempfile.TemporaryDirectory(prefix="packstore-empty-")
        self._empty = empty_store(self._scratch.name)
        self.get(DEFAULT_NAMESPACE)

    def _spec(self, namespace: str) -> StoreSpec:
        if self._bucket is None:
            return StoreSpec(str(namespace_path(self.data, namespace)), max_bytes=self.max_bytes)
        cache = self.data / CACHES_DIR / check_name(namespace)
        return replace(self._bucket, namespace=namespace, cache_dir=cache, cache_bytes=self.cache_bytes)

    def get(self, namespace: str) -> ServedStore:
        """The namespace's store, created if it has none (a write, or an admin action)."""
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = _served(self._spec(namespace))
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
        store = self.get(DEFAULT_NAMESPACE)
        assert isinstance(store, HoldsNamespaces)  # the object tier's stores say which namespaces hold objects
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
