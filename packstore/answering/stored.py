"""Stored packs without a model: the records ``build``, ``ls`` and ``inspect`` print, and pack files
(``export``, ``import``). Light on purpose: packctl's store commands load it and never import torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from packstore.errors import InvalidInput
from packstore.format.packfile import pack_file_parts, parse_pack_file
from packstore.kv.render import ERRATUM_PREFIX
from packstore.store.protocol import PackStore
from packstore.store.records import StoredPack


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
        "signatures": [
            {"key_id": sig.key_id, "created": sig.created, "valid": sig.subject == "pack" and sig.digest == h.pack_sha256 and sig.valid()}
            for sig in stored.signatures
        ],
    }


def export_pack(store: PackStore, ref: str, path: str | os.PathLike[str]) -> tuple[str, int]:
    """Write pack ``ref`` (checksums verified on read) to a single pack file; returns (key, bytes written).

    The file appears only when complete: it is written beside its final name and renamed.
    """
    encoded = store.get(ref)
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
    # Decoding is torch's until the pack reader decodes chunks without it: imported here, so that only import pays for it.
    from packstore.packs.tensors import decode_pack

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror}") from None
    encoded = parse_pack_file(data)
    decode_pack(encoded)
    key, created = store.put(encoded, name=name)
    return store.stat(key), created
