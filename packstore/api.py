"""The Python API that packctl shells over: build, store, export and import knowledge packs.

Answering with packs is ``packstore.answer.Answerer``.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from packstore.errors import InvalidInput
from packstore.tensors import Pack, decode_pack, encode_pack
from packstore.format.packfile import pack_file_parts, parse_pack_file
from packstore.kv.build import build_pack
from packstore.kv.models import LoadedModel
from packstore.store import PackStore, StoredPack


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
        "chunks": [asdict(c) for c in h.chunks],
        "facts": list(h.facts),
        "token_ids": list(h.token_ids),
    }


def store_pack(store: PackStore, pack: Pack, *, name: str | None = None) -> tuple[StoredPack, bool]:
    """Encode and store a pack; returns its stored record and whether it was new."""
    key, created = store.put(encode_pack(pack), name=name)
    return store.stat(key), created


def build_and_store(
    store: PackStore,
    lm: LoadedModel,
    facts: Sequence[str],
    *,
    name: str | None = None,
    raw: bool = False,
    progress: bool = False,
) -> tuple[StoredPack, bool]:
    """Build the pack for ``facts`` on ``lm`` and store it (idempotent: same facts, same key)."""
    return store_pack(store, build_pack(lm, facts, raw=raw, progress=progress), name=name)


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
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror}") from None
    encoded = parse_pack_file(data)
    decode_pack(encoded)
    key, created = store.put(encoded, name=name)
    return store.stat(key), created
