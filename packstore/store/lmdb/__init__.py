"""The LMDB tier: a store in one directory (``LmdbStore``), every write one transaction; it imports only the store core."""
