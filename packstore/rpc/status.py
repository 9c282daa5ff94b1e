"""Packstore errors over gRPC: a ``google.rpc.Status`` whose ``ErrorInfo`` carries the error's
code and fields, so a client raises the same class, with the same fields, as the server did."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from packstore.errors import (
    ERROR_CLASSES,
    ERROR_DOMAIN,
    IntegrityError,
    InvalidInput,
    LimitExceeded,
    PackNotFound,
    PackstoreError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)

# Statuses that reach a client without packstore's detail (from gRPC itself, or a foreign server).
_PLAIN_STATUS_ERRORS: dict[grpc.StatusCode, type[PackstoreError]] = {
    grpc.StatusCode.NOT_FOUND: PackNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.DATA_LOSS: IntegrityError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def status_for(error: PackstoreError) -> grpc.StatusCode:
    """The gRPC status code an error is answered with."""
    return grpc.StatusCode[error.grpc_status]


def rich_status(error: PackstoreError) -> grpc.Status:
    """The status for ``error``: code, human message, an ErrorInfo with its code and fields and, for a refusal that
    says when to retry (``retry_after_seconds``), the standard RetryInfo that gRPC clients and proxies read."""
    details = [error_details_pb2.ErrorInfo(reason=error.code, domain=ERROR_DOMAIN, metadata=error.fields)]
    if "retry_after_seconds" in error.fields:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(round(float(error.fields["retry_after_seconds"]) * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        packed.append(any_pb2.Any())
        packed[-1].Pack(detail)
    code = getattr(code_pb2, error.grpc_status)
    return rpc_status.to_status(status_pb2.Status(code=code, message=str(error), details=packed))


def abort_with_error(context: grpc.ServicerContext, error: PackstoreError) -> None:
    """End the RPC with ``error`` (raises, as ``context.abort`` does)."""
    context.abort_with_status(rich_status(error))


def _error_info(exc: grpc.RpcError) -> tuple[str, error_details_pb2.ErrorInfo] | None:
    try:
        status = rpc_status.from_call(exc)
    except ValueError:  # trailers that disagree with the status line: not ours
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN:
                return status.message, info
    return None


def error_from_rpc(exc: grpc.RpcError, peer: str) -> PackstoreError:
    """The packstore error a failed call stands for; ``peer`` names the server in messages."""
    found = _error_info(exc)
    if found is not None:
        message, info = found
        return ERROR_CLASSES.get(info.reason, PackstoreError).from_fields(message, dict(info.metadata))
    code, details = exc.code(), exc.details() or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Unavailable(f"{peer} is unavailable: {details or code.name.lower()}")
    kind = _PLAIN_STATUS_ERRORS.get(code)
    if kind is not None:
        return kind(details)
    return PackstoreError(f"{peer} answered {code.name}: {details}")
