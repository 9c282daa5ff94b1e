"""The embedded pack store: an LMDB environment in a directory. See docs/format.md."""

from packstore.store.lmdb_store import PackStore, StoredPack, default_store_path

__all__ = ["PackStore", "StoredPack", "default_store_path"]
