"""The summary record every store keeps beside a header, so listing never parses whole headers.

Shared by the LMDB store (database ``summaries``) and the object tier (``summaries/KEY`` objects):
one encoding, one parser, one definition of a pack's stored bytes.
"""

from __future__ import annotations

import json

from packstore.errors import IntegrityError
from packstore.format import PackHeader
from packstore.format.header import canonical_json
from packstore.store.records import PackSummary, StoredPack

_decode_json = json.JSONDecoder().decode


def pack_stored_bytes(header: PackHeader, header_json: bytes) -> int:
    """Bytes a pack occupies: its header JSON and every chunk."""
    return len(header_json) + sum(c.stored_bytes for c in header.chunks)


def summary_record(header: PackHeader, size: int) -> bytes:
    """A pack's summary without key and names, as canonical JSON (docs/format.md §5)."""
    summary = StoredPack(header=header, names=(), stored_bytes=size).summary
    record = {name: value for name, value in summary.__dict__.items() if name not in ("key", "names")}
    return canonical_json(record)


def parse_summary(key: str, names: tuple[str, ...], data: bytes) -> PackSummary:
    """The summary ``summary_record`` wrote, with its key and names; IntegrityError if it is damaged."""
    try:
        record = _decode_json(bytes(data).decode())
        record["parents"] = tuple(record["parents"])
        return PackSummary(key=key, names=names, **record)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"pack {key}: stored summary is damaged: {exc}") from None
