"""Backends of packs and banks, in bytes: the protocols, the records, the LMDB tier and the S3 object tier (the gRPC
client tier is ``packstore.rpc.remote``; ``packstore.packs.stores.open_store`` opens any of them by specifier)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packstore.store.protocol import BankStore, PackStore
from packstore.store.records import GcReport, PackPage, PackSummary, StoreCounts, StoredPack, VerifyResult

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
]
