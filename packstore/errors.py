"""Every error packstore raises on purpose, each with a stable code; nothing else lives here.

``code`` is the stable machine-readable name (it travels over gRPC as ``ErrorInfo.reason``),
``grpc_status`` the name of the gRPC status code the service answers with, and ``fields`` the
structured details (strings) a caller may act on. Messages are for people and never name CLI
flags. docs/protocol.md lists the codes.
"""

from __future__ import annotations

ERROR_DOMAIN = "packstore"


class PackstoreError(Exception):
    """Base class; an unexpected failure reported by a server arrives as this class itself."""

    code = "PACKSTORE_ERROR"
    grpc_status = "INTERNAL"

    def __init__(self, message: str, **fields: str) -> None:
        super().__init__(message)
        self.message = message
        self.fields = {name: str(value) for name, value in fields.items()}

    @classmethod
    def from_fields(cls, message: str, fields: dict[str, str]) -> PackstoreError:
        """Rebuild the error from its message and fields (how a client re-raises a server's error)."""
        return cls(message, **fields)


class PackNotFound(PackstoreError):
    """A key, name or bank resolves to nothing stored."""

    code = "NOT_FOUND"
    grpc_status = "NOT_FOUND"


class AmbiguousRef(PackstoreError):
    """A name or prefix resolves to several packs; the caller must say which (full key or model)."""

    code = "AMBIGUOUS_REF"
    grpc_status = "INVALID_ARGUMENT"


class PackMismatch(PackstoreError):
    """A pack does not apply to this model, template, conversation or embedder; never generate with it.

    ``what`` is one of ``"model"``, ``"template"``, ``"tokens"``, ``"kind"``, ``"embedder"``.
    """

    code = "PACK_MISMATCH"
    grpc_status = "FAILED_PRECONDITION"

    def __init__(self, what: str, message: str, **fields: str) -> None:
        super().__init__(message, what=what, **fields)
        self.what = what

    @classmethod
    def from_fields(cls, message: str, fields: dict[str, str]) -> PackMismatch:
        rest = {name: value for name, value in fields.items() if name != "what"}
        return cls(fields.get("what", ""), message, **rest)


class Unauthenticated(PackstoreError):
    """No token, or a token the service does not know."""

    code = "UNAUTHENTICATED"
    grpc_status = "UNAUTHENTICATED"


class PermissionDenied(PackstoreError):
    """The token may not do this (its role), or not in that namespace."""

    code = "PERMISSION_DENIED"
    grpc_status = "PERMISSION_DENIED"


class Untrusted(PackstoreError):
    """A pack or bank has no valid signature by a trusted key, where one is required; never used."""

    code = "UNTRUSTED"
    grpc_status = "FAILED_PRECONDITION"


class IntegrityError(PackstoreError):
    """Stored or received bytes do not match their checksum or cannot be decoded."""

    code = "DATA_LOSS"
    grpc_status = "DATA_LOSS"


class InvalidInput(PackstoreError):
    """A request, facts file, question file, model specifier or argument is unusable."""

    code = "INVALID_INPUT"
    grpc_status = "INVALID_ARGUMENT"


class LimitExceeded(PackstoreError):
    """A request is larger than a configured limit."""

    code = "LIMIT_EXCEEDED"
    grpc_status = "RESOURCE_EXHAUSTED"


class StoreBusy(PackstoreError):
    """An operation needs the store to itself, and another process has it open."""

    code = "STORE_BUSY"
    grpc_status = "UNAVAILABLE"


class StoreNotFound(PackstoreError):
    """The store a configuration names does not exist (an object store's bucket); nothing was read or written."""

    code = "STORE_NOT_FOUND"
    grpc_status = "FAILED_PRECONDITION"


class MissingExtra(PackstoreError):
    """A call needs an optional part of packstore this installation lacks (``extra``: the pip extra that adds it,
    ``module``: the module found missing); nothing was done."""

    code = "MISSING_EXTRA"
    grpc_status = "FAILED_PRECONDITION"


class Unavailable(PackstoreError):
    """A server could not be reached, or went away during the call."""

    code = "UNAVAILABLE"
    grpc_status = "UNAVAILABLE"


ERROR_CLASSES: dict[str, type[PackstoreError]] = {
    cls.code: cls
    for cls in (
        PackstoreError, PackNotFound, AmbiguousRef, PackMismatch, Untrusted, IntegrityError, InvalidInput, LimitExceeded, StoreBusy,
        StoreNotFound, Unavailable, Unauthenticated, PermissionDenied, MissingExtra,
    )
}
