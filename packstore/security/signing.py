"""Signing stored packs and banks, and checking them against trusted keys (no model needed, so no torch)."""

from __future__ import annotations

from typing import Sequence

from packstore.format.signature import Signature
from packstore.security.trust import SigningKey, TrustedKeys
from packstore.store.protocol import PackStore
from packstore.store.records import VerifyResult


def sign_pack(store: PackStore, ref: str, key: SigningKey, *, model_fp: str | None = None) -> tuple[str, Signature]:
    """Sign the pack ``ref``'s sealed digest (which covers every chunk) with ``key`` and store the
    signature with it (replacing an earlier one by the same key); returns the key and the signature."""
    stored = store.stat(ref, model_fp=model_fp)
    signature = key.sign("pack", stored.header.pack_sha256)
    return store.add_signature(stored.key, signature), signature


def sign_bank(store: PackStore, name: str, key: SigningKey) -> Signature:
    """Sign bank ``name``'s current digest (every record of it) with ``key`` and store the signature."""
    banks = store.banks()
    signature = key.sign("bank", banks.digest(name))
    banks.sign(name, signature)
    return signature


def verify_banks(store: PackStore, names: Sequence[str], trusted: TrustedKeys) -> list[VerifyResult]:
    """Per bank (default: every bank), None or why no trusted key signed its current contents."""
    banks = store.banks()
    names = list(names) or [meta.name for meta, _ in banks.list()]
    results = []
    for name in names:
        problem = trusted.problem("bank", banks.digest(name), banks.signatures(name))
        results.append(VerifyResult(name, f"not trusted: {problem}" if problem else None))
    return results


def verify_packs(store: PackStore, refs: Sequence[str], trusted: TrustedKeys | None = None) -> list[VerifyResult]:
    """Every checksum of ``refs`` (default: every pack), and with ``trusted`` also that a trusted key
    signed each pack; a failure of either is the result's error."""
    results = [store.verify(ref) for ref in refs] if refs else store.verify_all()
    if trusted is None:
        return results
    checked = []
    for result in results:
        if result.ok:
            stored = store.stat(result.key)
            problem = trusted.problem("pack", stored.header.pack_sha256, stored.signatures)
            result = VerifyResult(result.key, f"not trusted: {problem}" if problem else None)
        checked.append(result)
    return checked
