"""Copy every pack and bank of one store into another (a local store into a bucket and back, or any two tiers).

Packs keep their keys, names and signatures. A pack the target already holds is not read again:
only the names and signatures it lacks are added, so a second run copies nothing (and a run cut
short is finished by running it again). Each chunk is verified when read from the source and
again when the target takes it, and each copied pack is verified in the target afterwards.

Banks are copied record for record (``bank_records`` into ``put_bank_records``), so a copy has the
source's digest and routes alike, and its signatures stay valid. A bank the target holds with the
same digest is not copied again (only the signatures it lacks are added); one it holds under the
same name with other contents stops the run before anything is copied: migrate never replaces a
bank. A service (``grpc://``) takes and gives no bank records, so a bank that would have to be
copied to or from one is reported as skipped.
"""

from __future__ import annotations

from collections.abc import Callable

from packstore.errors import IntegrityError, InvalidInput, PackNotFound
from packstore.packs.reader import PackReader
from packstore.store.bank_records import BankChanged, StoredBanks, digest_of
from packstore.store.protocol import BankAdmin, BankRecords, BankRecordStore, PackStore, ServesBanks
from packstore.store.records import MigrateReport, StoredPack

Progress = Callable[[str, str], None]


def migrate(source: PackStore, target: PackStore, *, progress: Progress | None = None) -> MigrateReport:
    """Copy every pack of ``source`` with its names and signatures, and every bank with its signatures, into
    ``target``; ``progress(what, state)`` is told of each pack (its key) and bank (``bank NAME``): ``copied``,
    ``present`` or (a bank) ``skipped``. InvalidInput, before anything is copied, if the target holds a bank
    under a source bank's name with other contents; IntegrityError if a copy does not verify."""
    banks = _plan_banks(source, target)
    packs, copied, names, signatures = _copy_packs(source, target, progress)
    banks_copied, bank_signatures, skipped = _copy_banks(source, target, banks, progress)
    return MigrateReport(
        packs=packs, copied=copied, names_set=names, signatures_added=signatures,
        banks=len(banks), banks_copied=banks_copied, bank_signatures_added=bank_signatures, banks_skipped=skipped,
    )


def _copy_packs(source: PackStore, target: PackStore, progress: Progress | None) -> tuple[int, int, int, int]:
    """Copy the packs the target lacks and add the names and signatures it lacks: (packs, copied, names, signatures)."""
    copied = present = names = signatures = 0
    for summary in source.list():
        key = summary.key
        held: StoredPack | None
        try:
            held = target.stat(key)
        except PackNotFound:
            held = None
        new = held is None
        if held is None:
            target.put(PackReader(source).get(key))
            result = PackReader(target).verify(key)
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
    return copied + present, copied, names, signatures


def _banks(store: PackStore) -> BankRecordStore:
    """The record side of a store's banks: its own tables where this process holds them, else the service's."""
    if isinstance(store, BankAdmin):
        return StoredBanks(store)
    if isinstance(store, ServesBanks):
        return store.banks()
    raise InvalidInput(f"{type(store).__name__} keeps no banks")


def _bank_names(store: PackStore) -> list[str]:
    """Every bank's name: from its metadata records where the store holds them (no size scan), else from the service."""
    if isinstance(store, BankAdmin):
        return [meta.name for meta in store.bank_metas()]
    return [meta.name for meta, _ in _banks(store).list()]


def _plan_banks(source: PackStore, target: PackStore) -> list[tuple[str, str, bool]]:
    """Per source bank: its name, digest and whether the target holds it already. InvalidInput naming each
    bank the target holds under the same name with another digest (nothing is copied then)."""
    names = _bank_names(source)
    if not names:
        return []
    held = set(_bank_names(target))
    plans = [(name, _banks(source).digest(name), name in held) for name in names]
    differing = [name for name, digest, present in plans if present and _banks(target).digest(name) != digest]
    if differing:
        raise InvalidInput(
            f"the target holds {'a bank' if len(differing) == 1 else 'banks'} named like the source's with other contents: "
            f"{', '.join(map(repr, differing))}; migrate never replaces a bank, so nothing was copied: remove "
            f"{'it' if len(differing) == 1 else 'them'} from the target (packctl bank rm, on the target store) and run migrate again"
        )
    return plans


def _copy_banks(
    source: PackStore, target: PackStore, plans: list[tuple[str, str, bool]], progress: Progress | None
) -> tuple[int, int, tuple[str, ...]]:
    """Copy the planned banks the target lacks and add the signatures it lacks: (copied, signatures added, skipped)."""
    copied = signatures = 0
    skipped = []
    for name, digest, present in plans:
        if present:
            state = "present"
        elif isinstance(source, BankRecords) and isinstance(target, BankRecords):
            digest = _copy_bank(source, target, name)  # the source's bank may have changed since it was planned
            state, copied = "copied", copied + 1
        else:
            skipped.append(name)
            state = "skipped"
        if state != "skipped":
            signatures += _add_signatures(source, target, name, digest)
        if progress is not None:
            progress(f"bank {name}", state)
    return copied, signatures, tuple(skipped)


def _copy_bank(source: BankRecords, target: BankRecords, name: str) -> str:
    """Copy bank ``name``'s records byte for byte (the target checks each as it takes them), then check the
    copy in the target: the same records, the same digest. Returns the digest copied."""
    meta, records = source.bank_records(name)
    try:
        target.put_bank_records(name, meta, records)
    except BankChanged:
        raise InvalidInput(f"bank {name!r} appeared in the target while migrating: run migrate again") from None
    digest = digest_of(name, meta, [(record, data[-32:]) for record, data in records.items()])
    if target.bank_records(name) != (meta, records) or target.bank_digest(name) != digest:
        raise IntegrityError(f"bank {name!r} did not verify after copying: the target holds other records")
    return digest


def _add_signatures(source: PackStore, target: PackStore, name: str, digest: str) -> int:
    """Add the source's signatures of bank ``name``'s contents ``digest`` that the target lacks (one per key);
    signatures of older contents of the bank are left behind (no store takes them). Returns how many."""
    into = _banks(target)
    have = {s.key_id for s in into.signatures(name)}
    added = 0
    for signature in _banks(source).signatures(name):
        if signature.digest == digest and signature.key_id not in have:
            into.sign(name, signature)
            added += 1
    return added
