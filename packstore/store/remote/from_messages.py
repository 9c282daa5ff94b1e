"""The service's messages back to records: pack summaries, stored packs (the header's seal checked on the way) and
bank summaries (``service/to_messages.py`` writes them)."""

from __future__ import annotations

from packstore.format import PackHeader
from packstore.format.bank import BankMeta
from packstore.rpc.fields import signatures_of
from packstore.store.records import PackSummary, StoredPack
from packstore.v1 import store_pb2


def pack_summary(info: store_pb2.PackInfo) -> PackSummary:
    """A PackInfo back to the summary it carries."""
    fields = {name: getattr(info, name) for name in PackSummary.__dataclass_fields__}
    return PackSummary(
        **{**fields, "names": tuple(info.names), "parents": tuple(info.parents), "composition": info.composition or "exact"}
    )


def stored_pack(info: store_pb2.PackInfo) -> StoredPack:
    """A PackInfo with its header back to a StoredPack; the header's seal is checked on the way."""
    header = PackHeader.from_json(info.header_json)
    return StoredPack(header=header, names=tuple(info.names), stored_bytes=info.stored_bytes, signatures=signatures_of(info.signatures))


def bank_meta(info: store_pb2.BankInfo) -> tuple[BankMeta, int]:
    """A BankInfo back to (BankMeta, stored bytes)."""
    fields = {f: getattr(info, f) for f in BankMeta.__dataclass_fields__}
    return BankMeta(**fields), info.stored_bytes
