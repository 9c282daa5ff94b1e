"""A bounded, least-recently-used LMDB cache of immutable objects read from an object store.

The object tier keeps headers, summaries, name records and chunks here so that a replica reads
each from the object store once. Only objects that never change under their name are cached
(chunks are named by their digest; the others are checked against the object store's ETag by
their caller), and the caller verifies every value it reads back: a damaged entry is dropped
(``discard``) and fetched again, never served. Items hold at most ``max_bytes``; the least
recently used are evicted past it. The LMDB file itself may grow to twice that (freed pages are
reused, never returned); a write that finds it full evicts more, and if that does not help the
item is simply not cached: a full cache never fails a read.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb

from packstore.errors import LimitExceeded
from packstore.store.lmdb_environment import LmdbEnvironment

_FILE_SLACK = 64 << 20  # LMDB's own pages (tree branches, free lists) beyond the items
_U64 = struct.Struct(">Q")


class ObjectCache:
    """Bytes by object name, bounded in bytes, evicting the least recently used first.

    Databases: ``items`` (name -> bytes), ``used`` (name -> tick of its last use), ``order``
    (tick -> name, oldest first) and ``meta`` (the tick counter and the bytes held).
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._env = LmdbEnvironment(self.path, map_size=2 * max_bytes + _FILE_SLACK, max_dbs=4, max_size=2 * max_bytes + _FILE_SLACK)
        self._items = self._env.open_db(b"items", create=True)
        self._used = self._env.open_db(b"used", create=True)
        self._order = self._env.open_db(b"order", create=True)
        self._meta = self._env.open_db(b"meta", create=True)

    def close(self) -> None:
        self._env.close()

    def _counter(self, txn: lmdb.Transaction[bytes], name: bytes) -> int:
        data = txn.get(name, db=self._meta)
        return _U64.unpack(data)[0] if data is not None else 0

    def _touch(self, txn: lmdb.Transaction[bytes], name: bytes) -> None:
        """Make ``name`` the most recently used item."""
        old = txn.get(name, db=self._used)
        if old is not None:
            txn.delete(old, db=self._order)
        tick = _U64.pack(self._counter(txn, b"tick") + 1)
        txn.put(b"tick", tick, db=self._meta)
        txn.put(name, tick, db=self._used)
        txn.put(tick, name, db=self._order)

    def _remove(self, txn: lmdb.Transaction[bytes], name: bytes) -> None:
        data = txn.pop(name, db=self._items)
        if data is None:
            return
        tick = txn.pop(name, db=self._used)
        if tick is not None:  # every item has its tick; a damaged cache may lack it
            txn.delete(tick, db=self._order)
        txn.put(b"bytes", _U64.pack(self._counter(txn, b"bytes") - len(data)), db=self._meta)

    def _evict_to(self, txn: lmdb.Transaction[bytes], limit: int) -> None:
        """Drop least recently used items until at most ``limit`` bytes are held."""
        cursor = txn.cursor(db=self._order)
        while self._counter(txn, b"bytes") > limit and cursor.first():
            self._remove(txn, bytes(cursor.value()))

    def get(self, name: str) -> bytes | None:
        """The cached bytes of ``name`` (marked as just used), or None; the caller verifies them."""
        key = name.encode()
        with self._env.read() as txn:
            data = txn.get(key, db=self._items)
        if data is not None:
            try:
                self._env.write(lambda txn: self._touch(txn, key) if txn.get(key, db=self._items) is not None else None)
            except LimitExceeded:
                pass  # recency is a hint; the item is still good
        return data

    def put(self, name: str, data: bytes) -> None:
        """Cache ``data`` under ``name``, evicting the least recently used items to stay within the bound."""
        if len(data) > self.max_bytes:
            return
        key = name.encode()

        def body(txn: lmdb.Transaction[bytes], limit: int) -> None:
            self._remove(txn, key)
            self._evict_to(txn, limit - len(data))
            txn.put(key, data, db=self._items)
            txn.put(b"bytes", _U64.pack(self._counter(txn, b"bytes") + len(data)), db=self._meta)
            self._touch(txn, key)

        try:
            self._env.write(lambda txn: body(txn, self.max_bytes))
        except LimitExceeded:  # the file is full of free pages LMDB cannot reuse yet: make more room, else skip
            try:
                self._env.write(lambda txn: body(txn, self.max_bytes // 2))
            except LimitExceeded:
                pass

    def discard(self, name: str) -> None:
        """Drop ``name`` (its bytes failed verification)."""
        self._env.write(lambda txn: self._remove(txn, name.encode()))

    @property
    def held_bytes(self) -> int:
        """Bytes of the items held now (at most ``max_bytes``)."""
        with self._env.read() as txn:
            return self._counter(txn, b"bytes")

    def names(self) -> list[str]:
        """Every cached name, least recently used first."""
        with self._env.read() as txn:
            return [bytes(value).decode() for _, value in txn.cursor(db=self._order)]
