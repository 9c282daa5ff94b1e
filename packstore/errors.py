"""Exceptions shared by every layer; each carries a one-line message fit for a user."""


class PackstoreError(Exception):
    """Base class: every error packstore raises on purpose."""


class PackNotFound(PackstoreError):
    """A key or name resolves to no stored pack."""


class AmbiguousRef(PackstoreError):
    """A name resolves to packs of several models; the caller must say which."""


class PackMismatch(PackstoreError):
    """A pack does not apply to this model, template or conversation; never generate with it.

    ``what`` is one of ``"model"``, ``"template"``, ``"tokens"``, ``"kind"``, ``"embedder"``.
    """

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


class IntegrityError(PackstoreError):
    """Stored bytes do not match their checksum or cannot be decoded."""


class InvalidInput(PackstoreError):
    """A facts file, question file, model specifier or argument is unusable."""


class StoreBusy(PackstoreError):
    """An operation needs the store to itself, and another process has it open."""
