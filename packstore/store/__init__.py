"""The embedded pack store: an LMDB environment in a directory. See docs/format.md."""

from packstore.store.lmdb_store import GcReport, PackStore, StoredPack, VerifyResult, default_store_path

__all__ = ["GcReport", "PackStore", "StoredPack", "VerifyResult", "default_store_path"]
