"""One mapping between packstore errors and gRPC status codes, used by servers and clients."""

from __future__ import annotations

import grpc

from packstore.errors import (
    AmbiguousRef,
    IntegrityError,
    InvalidInput,
    PackMismatch,
    PackNotFound,
    PackstoreError,
    StoreBusy,
)


class LimitExceeded(PackstoreError):
    """A request is larger than the server's configured limits."""


_CODES: list[tuple[type[PackstoreError], grpc.StatusCode]] = [
    (PackNotFound, grpc.StatusCode.NOT_FOUND),
    (PackMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),  # first: clients map INVALID_ARGUMENT back to it
    (AmbiguousRef, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreBusy, grpc.StatusCode.UNAVAILABLE),
    (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def status_for(error: PackstoreError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, message: str) -> PackstoreError:
    """The client-side exception for a failed call, so remote and local stores raise alike."""
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        what = message.split(" ", 1)[0] if message.split(" ", 1)[0] in ("model", "template", "tokens", "kind") else "model"
        return PackMismatch(what, message)
    for kind, mapped in _CODES:
        if mapped == code and kind is not PackMismatch:
            return kind(message)
    return PackstoreError(f"{code.name.lower()}: {message}")
