"""Backends of packs and banks, in bytes. The store core (protocols, records, bank records, namespaces, the
store specifier) imports no tier; each tier has its folder and imports only the core: ``lmdb/`` (a directory),
``objects/`` (``s3://``), ``remote/`` (``grpc://``, the service). ``open_store`` here is the one factory that opens
them, and so the one place above the tiers that names them."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from packstore.store.protocol import BankStore, PackStore
from packstore.store.records import GcReport, PackPage, PackSummary, StoreCounts, StoredPack, VerifyResult
from packstore.store.spec import StoreSpec

if TYPE_CHECKING:
    from packstore.store.lmdb.store import LmdbStore


def open_store(spec: StoreSpec | str | os.PathLike[str] | None = None, *, readonly: bool = False) -> PackStore:
    """The store ``spec`` names (a string or None is read by ``StoreSpec.of``), opened by its tier; each tier is
    imported only when a store of it is opened. ``readonly`` opens a directory read-only; ``spec.timeout`` bounds each
    call to a service or a bucket."""
    spec = spec if isinstance(spec, StoreSpec) else StoreSpec.of(spec)
    if spec.tier == "s3":
        from packstore.store.objects.store import ObjectStore

        timed: dict[str, Any] = {} if spec.timeout is None else {"timeout": spec.timeout}
        return ObjectStore(
            spec.location, endpoint=spec.s3_endpoint, cache_dir=spec.cache_dir, cache_bytes=spec.cache_bytes, namespace=spec.namespace,
            **timed,
        )
    if spec.tier == "grpc":
        from packstore.store.remote.store import RemoteStore

        return RemoteStore(spec.location, connection=spec.connection, timeout=spec.timeout)
    from packstore.store.lmdb.store import LmdbStore

    sized = {} if spec.map_size is None else {"map_size": spec.map_size}
    return LmdbStore(spec.location, readonly=readonly, max_bytes=spec.max_bytes, **sized)


def __getattr__(name: str) -> Any:
    """``LmdbStore`` is imported on first use, so that records and protocols stay a light import (no lmdb)."""
    if name == "LmdbStore":
        from packstore.store.lmdb.store import LmdbStore

        return LmdbStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BankStore",
    "GcReport",
    "LmdbStore",
    "PackPage",
    "PackStore",
    "PackSummary",
    "StoreCounts",
    "StoredPack",
    "StoreSpec",
    "VerifyResult",
    "open_store",
]
