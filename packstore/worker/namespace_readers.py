"""The stores a worker reads, per caller namespace: its one configured store, or, when it authenticates
callers, that store seen through each caller's namespace (the worker's own token, the caller's namespace)."""

from __future__ import annotations

import threading
from dataclasses import replace

from packstore.rpc.channel import Connection
from packstore.store import PackStore, StoreSpec, open_store
from packstore.store.namespaces import DEFAULT_NAMESPACE, namespace_path


class NamespaceReaders:
    """``get(namespace)`` -> the store to read for callers in ``namespace``, opened once and kept.

    Without ``per_caller`` every caller reads the configured store (its token and namespace are the
    worker's own). With it, a remote store is reached with the worker's own token and the caller's
    namespace (the service checks that the worker's token may read it), an object store is read in the caller's
    namespace, and a local one is opened at that namespace's directory (docs/operations.md, "Tokens and namespaces").
    Local stores are opened read-only unless ``readonly`` is False (the vLLM connector's saves write through them)."""

    def __init__(self, spec: StoreSpec, *, per_caller: bool, readonly: bool = True) -> None:
        self.spec, self.per_caller, self.readonly = spec, per_caller, readonly
        self._stores: dict[str, PackStore] = {}
        self._lock = threading.Lock()
        if not per_caller:
            self.get(DEFAULT_NAMESPACE)  # fail at start, not at the first question, if it cannot be opened

    def get(self, namespace: str) -> PackStore:
        key = namespace if self.per_caller else DEFAULT_NAMESPACE
        with self._lock:
            if key not in self._stores:
                self._stores[key] = self._open(key)
            return self._stores[key]

    def _open(self, namespace: str) -> PackStore:
        if not self.per_caller:
            return open_store(self.spec, readonly=self.readonly)
        if self.spec.tier == "grpc":
            connection = replace(self.spec.connection or Connection.from_env(), namespace=namespace)
            return open_store(replace(self.spec, connection=connection))
        if self.spec.tier == "s3":
            return open_store(replace(self.spec, namespace=namespace))
        return open_store(namespace_path(self.spec.location, namespace), readonly=self.readonly)
    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()

    def __enter__(self) -> NamespaceReaders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
