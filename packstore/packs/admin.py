"""Store-only operations a user or ``packctl`` runs on any backend without the model stack (no torch): what a
pack's JSON record shows, verify (with trusted keys), export to and import from a pack file, sign."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packstore.errors import InvalidInput
from packstore.format.body import ERRATUM_PREFIX
from packstore.format.packfile import pack_file_parts, parse_pack_file
from packstore.format.signature import Signature
from packstore.packs.reader import PackReader, check_pack
from packstore.store.protocol import PackStore
from packstore.store.records import StoredPack, VerifyResult

if TYPE_CHECKING:
    from packstore.security.trust import SigningKey, TrustedKeys


def pack_summary(stored: StoredPack) -> dict[str, Any]:
    """The JSON record of a stored pack shared by ``build``, ``inspect`` and ``ls``."""
    return stored.summary.to_json()


def pack_details(stored: StoredPack) -> dict[str, Any]:
    """``pack_summary`` plus the full header: shapes, codec, chunks, facts and token ids."""
    h = stored.header
    return pack_summary(stored) | {
        "layers": h.layers,
        "kv_heads": h.kv_heads,
        "head_dim": h.head_dim,
        "codec": h.codec,
        "chunks": [c.to_record() for c in h.chunks],
        "facts": list(h.facts),
        "errata": [fact[len(ERRATUM_PREFIX) :] for fact in h.facts if fact.startswith(ERRATUM_PREFIX)],
        "token_ids": list(h.token_ids),
        "engine": dict(h.engine) if h.engine is not None else None,  # the serving engine that prefilled it, or None (packstore)
        "built_on": dict(h.built_on) if h.built_on is not None else None,  # the machine and software it was computed on
        "prefill_chunks": list(h.prefill_chunks) if h.prefill_chunks is not None else None,
        "signatures": [
            {"key_id": sig.key_id, "created": sig.created, "valid": sig.subject == "pack" and sig.digest == h.pack_sha256 and sig.valid()}
            for sig in stored.signatures
        ],
    }


def verify_packs(store: PackStore, refs: Sequence[str], trusted: TrustedKeys | None = None) -> list[VerifyResult]:
    """Every checksum of ``refs`` (default: every pack), and with ``trusted`` also that a trusted key
    signed each pack; a failure of either is the result's error."""
    reader = PackReader(store)
    results = [reader.verify(ref) for ref in refs] if refs else reader.verify_all()
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


def export_pack(store: PackStore, ref: str, path: str | os.PathLike[str]) -> tuple[str, int]:
    """Write pack ``ref`` (checksums verified on read) to a single pack file; returns (key, bytes written).

    The file appears only when complete: it is written beside its final name and renamed.
    """
    encoded = PackReader(store).get(ref)
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as out:
            for part in pack_file_parts(encoded):
                out.write(part)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise InvalidInput(f"cannot write {target}: {exc.strerror}") from None
    return encoded.header.key, target.stat().st_size


def import_pack(store: PackStore, path: str | os.PathLike[str], *, name: str | None = None) -> tuple[StoredPack, bool]:
    """Read a pack file, verify its seal, every checksum and that every chunk decodes, then store it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror}") from None
    encoded = parse_pack_file(data)
    check_pack(encoded.header, encoded.signatures, enumerate(encoded.chunks))
    key, created = store.put(encoded, name=name)
    return store.stat(key), created


def sign_pack(store: PackStore, ref: str, key: SigningKey, *, model_fp: str | None = None) -> tuple[str, Signature]:
    """Sign the pack ``ref``'s sealed digest (which covers every chunk) with ``key`` and store the
    signature with it (replacing an earlier one by the same key); returns the key and the signature."""
    stored = store.stat(ref, model_fp=model_fp)
    signature = key.sign("pack", stored.header.pack_sha256)
    return store.add_signature(stored.key, signature), signature
