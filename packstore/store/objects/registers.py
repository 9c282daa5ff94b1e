"""Mutable values (pack names, the gc lease) on an object store, with no lost update.

A register at path ``P`` is a log of create-only objects ``P/SEQ`` (SEQ: 20 decimal digits, so
name order is numeric order); its value is the newest one's. To change it, a writer reads the
newest ``P/N`` and creates ``P/N+1`` with ``If-None-Match: *``: of writers racing from the same
``N`` exactly one succeeds, and the others read again and redo their change on the new value. So
every change is made on the value it saw (compare-and-swap), and a delete of a name that another
writer just deleted is refused instead of both succeeding. Only create-only writes are needed,
which AWS S3, MinIO, Ceph RGW and SeaweedFS all make atomic (SeaweedFS 4.48's ``If-Match`` is
not: two writers holding the same ETag both succeed, docs/operations.md). Every version names its
writer (``claim``), so a create whose answer was lost and whose retry got 412 is recognised as
the writer's own. Versions are immutable, so readers cache them forever; gc removes all but the
newest, never the newest (a reused SEQ could let two writers both win).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packstore.errors import IntegrityError, StoreBusy
from packstore.format.header import canonical_json
from packstore.store.objects.bucket import Bucket, Conflict, Listed

SEQ_DIGITS = 20
MAX_ATTEMPTS = 64
UNCHANGED = object()  # what a change returns to leave the register as it is


@dataclass(frozen=True)
class Version:
    """One version of a register: its number, value (None: cleared), writer's claim and object name."""

    seq: int
    value: Any
    claim: str
    name: str


def _seq(listed: Listed) -> int | None:
    last = listed.name.rsplit("/", 1)[1]
    return int(last) if len(last) == SEQ_DIGITS and last.isdigit() else None


class Registers:
    """The registers below one object prefix; ``read(name, etag)`` fetches (and caches) one version's bytes."""

    def __init__(self, bucket: Bucket, read: Callable[[str, str | None], bytes | None]) -> None:
        self.bucket = bucket
        self._read = read

    def _version(self, name: str, etag: str | None) -> Version | None:
        data = self._read(name, etag)
        if data is None:
            return None
        try:
            record = json.loads(data)
            return Version(int(name.rsplit("/", 1)[1]), record["value"], str(record["claim"]), name)
        except (ValueError, TypeError, KeyError) as exc:
            raise IntegrityError(f"register version {name} is damaged: {exc}") from None

    def versions(self, prefix: str) -> dict[str, list[Listed]]:
        """Every register below ``prefix`` (by path) with its version objects, oldest first; one listing."""
        found: dict[str, list[Listed]] = {}
        for listed in self.bucket.list(prefix):
            if _seq(listed) is not None:
                found.setdefault(listed.name.rsplit("/", 1)[0], []).append(listed)
        return found

    def newest(self, versions: list[Listed]) -> Version | None:
        """The value a register's versions (as listed) give it."""
        return self._version(versions[-1].name, versions[-1].etag) if versions else None

    def latest(self, path: str) -> Version | None:
        """The newest version of the register at ``path``, or None if it was never written."""
        return self.newest(self.versions(f"{path}/").get(path, []))

    def update(self, path: str, change: Callable[[Version | None], Any]) -> tuple[Version | None, Version | None]:
        """Apply ``change`` (newest version -> new value, or UNCHANGED) atomically; returns (before, after).

        ``change`` may run several times (once per lost race) and may raise to refuse the update.
        """
        for attempt in range(MAX_ATTEMPTS):
            current = self.latest(path)
            value = change(current)
            if value is UNCHANGED:
                return current, current
            seq = current.seq + 1 if current else 0
            claim = uuid.uuid4().hex
            name = f"{path}/{seq:0{SEQ_DIGITS}d}"
            try:
                self.bucket.put(name, canonical_json({"claim": claim, "value": value}), create_only=True)
                return current, Version(seq, value, claim, name)
            except Conflict:
                winner = self._version(name, None)
                if winner is not None and winner.claim == claim:  # our own write, answered 412 on a retry
                    return current, winner
            time.sleep(random.uniform(0, min(1.0, 0.01 * 2**attempt)))
        raise StoreBusy(f"register {path} changed {MAX_ATTEMPTS} times while this writer tried to change it; try again")
