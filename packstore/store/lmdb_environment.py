"""One LMDB environment shared by the threads of a process, whose map grows without breaking a transaction.

LMDB lets a process change its map size only while it has no transaction open
(``mdb_env_set_mapsize``), and py-lmdb invalidates every open transaction when it does. So every
transaction here holds a readers-writer lock shared, and growing the map, adopting a size another
process grew it to (``MDB_MAP_RESIZED``), rolling back a failed write, compacting and closing hold
it exclusive. A large map is reserved up front, as py-lmdb recommends on 64-bit: it costs address
space, not disk, so growth is rare; the lock makes it safe when it happens. docs/operations.md
states the rules.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Literal, TypeVar, overload

import lmdb

from packstore.errors import IntegrityError, LimitExceeded, StoreBusy

DEFAULT_MAP_SIZE = 1 << 40  # 1 TiB of address space; the file holds only what is stored
_SMALLEST_RESERVATION = 1 << 26  # where an address-space limit stops the halving of the reservation
T = TypeVar("T")
# What LMDB raises on a damaged file: reported as the DATA_LOSS they are, not as a crash of the call.
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.PanicError)


class SharedExclusiveLock:
    """A readers-writer lock that prefers writers.

    A thread that holds it, either way, may take it shared again without waiting (a read inside a
    write's body); it cannot take it exclusive while it holds it, which would wait for itself.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._sharers = 0  # threads holding it shared
        self._writers_waiting = 0
        self._owner: int | None = None  # the thread holding it exclusive
        self._local = threading.local()

    def held(self) -> bool:
        """Whether this thread holds the lock, shared or exclusive."""
        return getattr(self._local, "depth", 0) > 0 or self._owner == threading.get_ident()

    @contextmanager
    def shared(self) -> Iterator[bool]:
        """Hold the lock shared; yields whether this is the thread's outermost hold."""
        if self.held():
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                yield False
            finally:
                self._local.depth -= 1
            return
        with self._changed:
            while self._owner is not None or self._writers_waiting:
                self._changed.wait()
            self._sharers += 1
        self._local.depth = 1
        try:
            yield True
        finally:
            self._local.depth = 0
            with self._changed:
                self._sharers -= 1
                if not self._sharers:
                    self._changed.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock alone: waits for every shared holder to leave, and new ones wait behind it."""
        if self.held():
            raise StoreBusy("this thread is inside a transaction of the store, so it cannot have the store to itself")
        with self._changed:
            self._writers_waiting += 1
            try:
                while self._owner is not None or self._sharers:
                    self._changed.wait()
            finally:
                self._writers_waiting -= 1
            self._owner = threading.get_ident()
        try:
            yield
        finally:
            with self._changed:
                self._owner = None
                self._changed.notify_all()


class LmdbEnvironment:
    """An ``lmdb.Environment`` whose transactions never see the map change under them.

    ``map_size`` is the address space reserved at open (the data file grows only as data is
    stored); a write that finds the map full grows it and runs again, and a transaction that finds
    the map grown by another process adopts the new size and begins again.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        readonly: bool = False,
        max_dbs: int = 16,
        max_size: int | None = None,
    ) -> None:
        """``max_size``: the most the data file may hold; a write that would need more fails with
        LimitExceeded (the store is full), while reads go on."""
        self.path = Path(path)
        self.readonly = readonly
        self.max_size = max_size
        if max_size is not None:
            existing = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").exists() else 0
            map_size = max(min(map_size, max_size), existing)
        self._requested_map_size = map_size
        self._max_dbs = max_dbs
        self._lock = SharedExclusiveLock()
        self._one_writer = threading.RLock()
        self._env = self._open()

    def _open(self) -> lmdb.Environment:
        """Open the environment, halving the reservation while an address-space limit refuses it."""
        size = self._requested_map_size
        while True:
            try:
                return lmdb.open(
                    str(self.path), map_size=size, max_dbs=self._max_dbs, readonly=self.readonly, subdir=True
                )
            except lmdb.MemoryError:
                if size // 2 < min(self._requested_map_size, _SMALLEST_RESERVATION):
                    raise
                size //= 2

    @property
    def map_size(self) -> int:
        """The bytes this process has mapped (the most the data file may grow to before the map grows)."""
        return self._env.info()["map_size"]

    def open_db(self, name: bytes, *, create: bool) -> lmdb._Database:
        """A named database's handle, created first when ``create`` (in a write that may grow the map)."""
        if create:
            return self.write(lambda txn: self._env.open_db(name, txn=txn, create=True))
        with self._lock.shared():  # a handle opened in a read transaction would close with it
            return self._env.open_db(name, create=False)

    @overload
    def read(self, *, buffers: Literal[False] = False) -> AbstractContextManager[lmdb.Transaction[bytes]]: ...

    @overload
    def read(self, *, buffers: Literal[True]) -> AbstractContextManager[lmdb.Transaction[memoryview]]: ...

    @overload
    def read(self, *, buffers: bool) -> AbstractContextManager[lmdb.Transaction]: ...

    def read(self, *, buffers: bool = False) -> AbstractContextManager[lmdb.Transaction]:
        """A read transaction; with ``buffers`` values are memoryviews valid only inside it."""
        return self._read(buffers)

    @contextmanager
    def _read(self, buffers: bool) -> Iterator[lmdb.Transaction]:
        while True:
            with self._lock.shared() as outermost:
                try:
                    txn: lmdb.Transaction = self._env.begin(buffers=True) if buffers else self._env.begin()
                except lmdb.MapResizedError:
                    if not outermost:
                        raise StoreBusy("another process grew the store while this thread holds a transaction") from None
                else:
                    try:
                        with txn:
                            yield txn
                    except _DAMAGE as exc:
                        raise IntegrityError(f"store {self.path} is damaged: {exc}; restore it from a backup") from None
                    return
            self._adopt_grown_map()

    def write(self, body: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``body(txn)`` in one write transaction and commit it, growing the map and rerunning it when full.

        ``body`` may run more than once, each time in a fresh transaction, so it must not act outside it.
        One thread of the process writes at a time (LMDB allows one write transaction anyway), so a
        failed writer can wait for the lock exclusive without another writer holding it shared.
        """
        with self._one_writer:
            while True:
                with self._lock.shared() as outermost:
                    seen = self.map_size
                    txn = None
                    try:
                        txn = self._env.begin(write=True)
                        result = body(txn)
                        txn.commit()
                        return result
                    except BaseException as exc:
                        damaged = isinstance(exc, _DAMAGE)
                        failure = IntegrityError(f"store {self.path} is damaged: {exc}; restore it from a backup") if damaged else exc
                        if not outermost:  # the lock cannot turn exclusive under this thread's own transaction
                            if txn is not None:
                                txn.abort()
                            if isinstance(exc, (lmdb.MapFullError, lmdb.MapResizedError)):
                                raise StoreBusy("the store's map must grow, and this thread holds a transaction") from exc
                            raise
                self._recover(txn, failure, seen)

    def _recover(self, txn: lmdb.Transaction | None, failure: BaseException, seen: int) -> None:
        """Abort a failed write, then grow or adopt the map if that was why, else raise ``failure``.

        The abort runs with the lock exclusive: py-lmdb 3.0 stalls aborting a write transaction for as
        long as other threads keep beginning transactions (measured: minutes under 16 streaming threads).
        """
        with self._lock.exclusive():
            if txn is not None:
                txn.abort()
            if isinstance(failure, lmdb.MapResizedError):
                self._env.set_mapsize(0)
            elif not isinstance(failure, lmdb.MapFullError):
                raise failure
            elif self.map_size == seen:  # else a reader adopted a size another process grew it to
                if self.max_size is not None and seen >= self.max_size:
                    raise LimitExceeded(f"store {self.path} is full: it holds its configured maximum of {self.max_size} bytes") from None
                used = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
                grown = max(2 * seen, 2 * used)
                self._env.set_mapsize(grown if self.max_size is None else min(grown, self.max_size))

    def _adopt_grown_map(self) -> None:
        """Map the size another process grew the environment to (``set_mapsize(0)`` adopts it)."""
        with self._lock.exclusive():
            self._env.set_mapsize(0)

    def compact(self, scratch: Path, reopened: Callable[[], None]) -> None:
        """Copy the environment without free pages into ``scratch``, swap the copy in and reopen it.

        No transaction of this process is open meanwhile; ``reopened`` runs before any begins again,
        to reopen the database handles. Other processes must not have the environment open.
        """
        with self._lock.exclusive():
            self._env.copy(str(scratch), compact=True)
            self._env.close()
            try:
                os.replace(scratch / "data.mdb", self.path / "data.mdb")
            finally:
                self._env = self._open()
                reopened()

    def copy_to(self, directory: Path) -> None:
        """A consistent copy of the environment (one read snapshot, free pages dropped) into the empty
        ``directory``, while other transactions, and other processes, go on writing."""
        with self._lock.shared():
            self._env.copy(str(directory), compact=True)

    def close(self) -> None:
        """Close the environment once every transaction of this process has ended."""
        with self._lock.exclusive():
            self._env.close()
