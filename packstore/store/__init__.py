"""Stores of packs and banks: the protocols, the embedded LMDB store, and the gRPC client store."""

from __future__ import annotations

import os

from packstore.records import GcReport, PackPage, PackSummary, StoreCounts, StoredPack, VerifyResult
from packstore.store.lmdb_store import LmdbStore, default_store_path
from packstore.store.protocol import BankStore, PackStore


def is_remote(spec: str | os.PathLike[str] | None) -> bool:
    """Whether a store specifier names a service (``grpc://`` or ``grpcs://HOST:PORT``) rather than a directory."""
    return str(spec or "").startswith(("grpc://", "grpcs://"))


def open_store(spec: str | os.PathLike[str] | None = None, *, readonly: bool = False, connection=None) -> PackStore:
    """The store a specifier names: ``grpc://HOST:PORT`` (``grpcs://`` for TLS) is the service, with
    ``connection``'s TLS files, token and namespace (default: from the environment); anything else a
    local directory. Without ``spec``: ``$PACKSTORE_STORE``, else the per-user data directory.
    """
    spec = str(spec or os.environ.get("PACKSTORE_STORE") or default_store_path())
    if is_remote(spec):
        from packstore.store.remote import RemoteStore

        return RemoteStore(spec, connection=connection)
    return LmdbStore(spec, readonly=readonly)


__all__ = [
    "BankStore",
    "GcReport",
    "LmdbStore",
    "PackPage",
    "PackStore",
    "PackSummary",
    "StoreCounts",
    "StoredPack",
    "VerifyResult",
    "default_store_path",
    "is_remote",
    "open_store",
]
