"""``packctl backup``: a consistent hot copy of a store directory and of each of its namespaces."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from packstore.errors import InvalidInput
from packstore.store import open_store
from packstore.store.namespaces import namespace_path, namespaces_at
from packstore.store.protocol import BacksUp


@dataclass(frozen=True)
class BackupReport:
    """What a backup copied: per namespace, its packs and stored bytes, and the copy's size on disk."""

    destination: str
    namespaces: dict[str, dict[str, int]]


def backup(data: str | Path, destination: str | Path) -> BackupReport:
    """A consistent hot copy of the store at ``data``, and of each of its namespaces, into ``destination``
    (which must not exist): each store is copied from one read snapshot of it (so every pack in the
    copy is complete, and every pack committed before the copy began is in it) while writers go on;
    the copy is written beside ``destination`` and renamed into place only when whole. The copy is a
    store: restore by pointing ``--data``/``--store`` at it, or by putting it in the original's place."""
    source, target = Path(data), Path(destination)
    if target.exists():
        raise InvalidInput(f"backup destination {target} exists: give a new path")
    namespaces = namespaces_at(source)
    if not namespaces:
        raise InvalidInput(f"no pack store at {source}")
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    copied: dict[str, dict[str, int]] = {}
    try:
        for namespace in namespaces:
            into = namespace_path(partial, namespace)
            into.mkdir(parents=True)
            with open_store(namespace_path(source, namespace), readonly=True) as store:
                assert isinstance(store, BacksUp)  # a directory opens as the LMDB tier
                store.backup_into(into)
            with open_store(into, readonly=True) as copy:
                counts = copy.counts()
            file_bytes = (into / "data.mdb").stat().st_size
            copied[namespace] = {"packs": counts.packs, "stored_bytes": counts.stored_bytes, "file_bytes": file_bytes}
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return BackupReport(str(target), copied)
