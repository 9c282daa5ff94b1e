"""The record side of a local tier's banks: list, size, delete, digest, signatures and signing, without an embedder.

``bank.bank.LocalBanks`` adds building, adding and routing (which embed) on top; migrate and the other store-only
tools use this alone, so they need no model stack."""

from __future__ import annotations

from packstore.format.bank import BankMeta
from packstore.format.signature import Signature
from packstore.store.protocol import BankTables


class StoredBanks:
    """The banks kept in ``store``'s bank tables, as records."""

    def __init__(self, store: BankTables) -> None:
        self.store = store

    def list(self) -> list[tuple[BankMeta, int]]:
        """Every bank with its stored bytes."""
        return [(meta, self.store.bank_stored_bytes(meta.name)) for meta in self.store.bank_metas()]

    def stored_bytes(self, name: str) -> int:
        self.store.bank(name)
        return self.store.bank_stored_bytes(name)

    def delete(self, name: str) -> None:
        self.store.delete_bank(name)

    def digest(self, name: str) -> str:
        return self.store.bank_digest(name)

    def signatures(self, name: str) -> tuple[Signature, ...]:
        return self.store.bank_signatures(name)

    def sign(self, name: str, signature: Signature) -> None:
        self.store.sign_bank(name, signature)
