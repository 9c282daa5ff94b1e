"""Pack headers as a paged-attention connector needs them: from memory on every request, from the store once.

A key's header never changes, so headers are kept by key; a ref (a name, or a key) is resolved to its key at most
once per ``ttl`` seconds, since a name may be moved to another pack, and a ref the store does not hold is remembered as
missing for as long (a chain's composition looked up on every request would read the store every time).
``get(..., lookup=False)`` never touches the store: it raises ``HeaderNeeded`` instead, so the caller can look the
header up off its own thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from packstore.errors import PackNotFound
from packstore.format.header import PackHeader
from packstore.store.records import StoredPack

KEYS_REMEMBERED = 65536  # headers kept by key, least recently used forgotten first (each: its token ids and a few fields)


class HeaderNeeded(Exception):
    """The header of ``ref`` in ``namespace`` is not in memory: it must be looked up in the store."""

    def __init__(self, namespace: str, ref: str) -> None:
        super().__init__(f"the header of pack {ref!r} in namespace {namespace!r} is not in memory")
        self.namespace, self.ref = namespace, ref


class PackHeaders:
    """Headers by (namespace, key), and refs resolved to keys for ``ttl`` seconds; ``stat(namespace, ref)`` reads
    a ref's stored pack (it may raise, and then nothing is remembered). Safe to use from several threads."""

    def __init__(self, stat: Callable[[str, str], StoredPack], *, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stat, self.ttl, self._clock = stat, ttl, clock
        self._by_key: OrderedDict[tuple[str, str], PackHeader] = OrderedDict()
        self._keys: dict[tuple[str, str], tuple[str, float]] = {}  # (namespace, ref) -> (key, when resolved)
        # (namespace, ref) -> (why, when found missing): the message, not the exception, whose traceback would keep the
        # frames of the store's read alive (an LMDB read transaction holds its reader slot until it is freed)
        self._missing: dict[tuple[str, str], tuple[str, float]] = {}
        self._saving: set[tuple[str, str]] = set()  # keys a request is saving: never remembered missing meanwhile
        self._lock = threading.Lock()
        self.lookups = 0  # reads of the store, for tests and logs

    def get(self, namespace: str, ref: str, *, lookup: bool = True) -> PackHeader:
        """The header ``ref`` names in ``namespace``: from memory when its key is known (a ref resolved less than
        ``ttl`` seconds ago), else read from the store, or ``HeaderNeeded`` when ``lookup`` is False."""
        remembered = self.remembered(namespace, ref)
        if remembered is not None:
            return remembered
        if not lookup:
            raise HeaderNeeded(namespace, ref)
        with self._lock:
            self.lookups += 1
        try:
            stored = self._stat(namespace, ref)
        except PackNotFound as missing:
            with self._lock:
                if (namespace, ref) in self._saving:  # it may be stored any moment: the next request looks again
                    raise
                self._missing[(namespace, ref)] = (str(missing), self._clock())
                if len(self._missing) > KEYS_REMEMBERED:
                    self._missing = {name: found for name, found in self._missing.items() if self._clock() - found[1] <= self.ttl}
            raise
        self.keep(namespace, stored.header, ref=ref)
        return stored.header

    def remembered(self, namespace: str, ref: str) -> PackHeader | None:
        """The header ``ref`` names from memory, or None; ``PackNotFound`` for a ref found missing within ``ttl``."""
        with self._lock:
            missing, when = self._missing.get((namespace, ref), (None, 0.0))
            if missing is not None and self._clock() - when <= self.ttl:
                raise PackNotFound(missing)
            header = self._by_key.get((namespace, ref))  # a key is its own ref, for good
            if header is None:
                key, when = self._keys.get((namespace, ref), (None, 0.0))
                if key is None or self._clock() - when > self.ttl:
                    return None
                header = self._by_key.get((namespace, key))
            if header is not None:
                self._by_key.move_to_end((namespace, header.key))
            return header

    def keep(self, namespace: str, header: PackHeader, *, ref: str | None = None) -> None:
        """Remember ``header`` (and that ``ref`` names it, for ``ttl`` seconds)."""
        with self._lock:
            self._by_key[(namespace, header.key)] = header
            self._by_key.move_to_end((namespace, header.key))
            self._missing.pop((namespace, header.key), None)
            if ref is not None and ref != header.key:
                self._keys[(namespace, ref)] = (header.key, self._clock())
            while len(self._by_key) > KEYS_REMEMBERED:
                self._by_key.popitem(last=False)
            if len(self._keys) > KEYS_REMEMBERED:
                self._keys = {name: found for name, found in self._keys.items() if self._clock() - found[1] <= self.ttl}

    def saving(self, namespace: str, key: str) -> None:
        """A request will save pack ``key``: until ``save_ended``, a lookup that finds it missing is not remembered (the
        next request, which may come the moment it is stored, reads the store again)."""
        with self._lock:
            self._saving.add((namespace, key))
            self._missing.pop((namespace, key), None)

    def save_ended(self, namespace: str, key: str) -> None:
        """The save of ``key`` ended (stored, or failed): lookups of it are remembered again."""
        with self._lock:
            self._saving.discard((namespace, key))
            self._missing.pop((namespace, key), None)

    def forget(self, namespace: str) -> None:
        """Forget every header and name of ``namespace`` (its store failed to deliver a pack: look it up again before
        another load is planned from it)."""
        with self._lock:
            self._by_key = OrderedDict((found, header) for found, header in self._by_key.items() if found[0] != namespace)
            self._keys = {name: found for name, found in self._keys.items() if name[0] != namespace}
            self._missing = {name: found for name, found in self._missing.items() if name[0] != namespace}
