"""Bind a gRPC server's port, plain or TLS (mutual when a client CA is given), for the service and the worker."""

from __future__ import annotations

from pathlib import Path

import grpc

from packstore.errors import InvalidInput


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc.strerror}") from None


def bind(server: grpc.Server, listen: str, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "") -> bool:
    """Add ``listen`` to ``server``: TLS with ``tls_cert``/``tls_key`` (and, with ``tls_client_ca``,
    requiring client certificates signed by it), else plain. Returns whether TLS is on."""
    if bool(tls_cert) != bool(tls_key):
        raise InvalidInput("TLS needs both a certificate and its key")
    if tls_client_ca and not tls_cert:
        raise InvalidInput("a TLS client CA (mutual TLS) needs the server's own certificate and key too")
    if tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(_read(tls_key, "TLS key"), _read(tls_cert, "TLS certificate"))],
            root_certificates=_read(tls_client_ca, "TLS client CA") if tls_client_ca else None,
            require_client_auth=bool(tls_client_ca),
        )
        bound = server.add_secure_port(listen, credentials)
    else:
        bound = server.add_insecure_port(listen)
    if bound == 0:
        raise InvalidInput(f"cannot listen on {listen}")
    return bool(tls_cert)
