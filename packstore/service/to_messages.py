"""Records as the messages the service sends: pack and bank summaries (``store/remote/from_messages.py`` reads them
back)."""

from __future__ import annotations

from packstore.format.bank import BankMeta
from packstore.store.records import PackSummary, StoredPack
from packstore.v1 import store_pb2


def summary_info(summary: PackSummary) -> store_pb2.PackInfo:
    """A pack's summary as a PackInfo without the header (what ListPacks pages carry)."""
    return store_pb2.PackInfo(**{**summary.__dict__, "names": list(summary.names), "parents": list(summary.parents)})


def pack_info(stored: StoredPack) -> store_pb2.PackInfo:
    """A pack's summary and its full sealed header."""
    info = summary_info(stored.summary)
    info.header_json = stored.header.to_json()
    info.signatures.extend(signature.to_json().decode() for signature in stored.signatures)
    return info


def bank_info(meta: BankMeta, stored_bytes: int) -> store_pb2.BankInfo:
    return store_pb2.BankInfo(stored_bytes=stored_bytes, **meta.__dict__)
