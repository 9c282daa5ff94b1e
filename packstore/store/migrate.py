"""Copy every pack of one store into another (a local store into a bucket and back, or any two tiers).

Packs keep their keys, names and signatures. A pack the target already holds is not read again:
only the names and signatures it lacks are added, so a second run copies nothing (and a run cut
short is finished by running it again). Each chunk is verified when read from the source and
again when the target takes it, and each copied pack is verified in the target afterwards.
"""

from __future__ import annotations

from typing import Callable

from packstore.errors import IntegrityError, PackNotFound
from packstore.records import MigrateReport
from packstore.store.protocol import PackStore


def migrate(source: PackStore, target: PackStore, *, progress: Callable[[str, str], None] | None = None) -> MigrateReport:
    """Copy every pack of ``source`` with its names and signatures into ``target``; ``progress(key, what)``
    is told of each pack (``copied`` or ``present``). IntegrityError if a copy does not verify."""
    copied = present = names = signatures = 0
    for summary in source.list():
        key = summary.key
        try:
            held = target.stat(key)
        except PackNotFound:
            held = None
        new = held is None
        if new:
            target.put(source.get(key))
            result = target.verify(key)
            if not result.ok:
                raise IntegrityError(f"pack {key} did not verify after copying: {result.error}")
            held, copied = target.stat(key), copied + 1
        else:
            present += 1
            have = {s.key_id for s in held.signatures}
            for signature in source.stat(key).signatures:
                if signature.key_id not in have:
                    target.add_signature(key, signature)
                    signatures += 1
        for name in summary.names:
            if name not in held.names:
                target.set_name(key, name)
                names += 1
        if progress is not None:
            progress(key, "copied" if new else "present")
    return MigrateReport(packs=copied + present, copied=copied, names_set=names, signatures_added=signatures)
