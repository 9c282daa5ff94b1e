"""Stores of packs and banks: the protocols, the embedded LMDB store, and the gRPC client store."""

from __future__ import annotations

import os

from packstore.store.records import GcReport, PackPage, PackSummary, StoreCounts, StoredPack, VerifyResult
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packstore.store.protocol import BankStore, PackStore

if TYPE_CHECKING:
    from packstore.store.lmdb.store import LmdbStore


def default_store_path() -> Path:
    """``$PACKSTORE_STORE``, else ``$XDG_DATA_HOME/packstore``, else ``~/.local/share/packstore``."""
    if os.environ.get("PACKSTORE_STORE"):
        return Path(os.environ["PACKSTORE_STORE"])
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "packstore"


def __getattr__(name: str) -> Any:
    """``LmdbStore`` is imported on first use, so that records and protocols stay a light import (no lmdb)."""
    if name == "LmdbStore":
        from packstore.store.lmdb.store import LmdbStore

        return LmdbStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_remote(spec: str | os.PathLike[str] | None) -> bool:
    """Whether a store specifier names a service (``grpc://`` or ``grpcs://HOST:PORT``) or an object store
    (``s3://BUCKET/PREFIX``) rather than a directory: reached through a ``Connection``."""
    return str(spec or "").startswith(("grpc://", "grpcs://", "s3://"))


def open_store(spec: str | os.PathLike[str] | None = None, *, readonly: bool = False, connection=None) -> PackStore:
    """The store a specifier names: ``grpc://HOST:PORT`` (``grpcs://`` for TLS) is the service, with
    ``connection``'s TLS files, token and namespace; ``s3://BUCKET/PREFIX`` the object store at
    ``connection``'s endpoint, in its namespace, with a temporary cache; anything else a local
    directory. ``connection`` defaults to the environment's. Without ``spec``: ``$PACKSTORE_STORE``,
    else the per-user data directory.
    """
    spec = str(spec or os.environ.get("PACKSTORE_STORE") or default_store_path())
    if spec.startswith("s3://"):
        from packstore.rpc.channel import Connection
        from packstore.store.namespaces import DEFAULT_NAMESPACE
        from packstore.store.objects.store import ObjectStore

        connection = connection or Connection.from_env()
        return ObjectStore(spec, endpoint=connection.s3_endpoint, namespace=connection.namespace or DEFAULT_NAMESPACE)
    if is_remote(spec):
        from packstore.store.remote import RemoteStore

        return RemoteStore(spec, connection=connection)
    from packstore.store.lmdb.store import LmdbStore

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
