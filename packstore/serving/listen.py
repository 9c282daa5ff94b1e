"""Bind a gRPC server's port, plain or TLS (mutual when a client CA is given), for the service and the worker;
and the same TLS for a plain socket (the service's bulk port)."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from packstore.errors import InvalidInput


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc.strerror}") from None


def _check_tls_files(tls_cert: str, tls_key: str, tls_client_ca: str) -> None:
    if bool(tls_cert) != bool(tls_key):
        raise InvalidInput("TLS needs both a certificate and its key")
    if tls_client_ca and not tls_cert:
        raise InvalidInput("a TLS client CA (mutual TLS) needs the server's own certificate and key too")


def bind(server: grpc.Server | grpc.aio.Server, listen: str, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "") -> bool:
    """Add ``listen`` to ``server``: TLS with ``tls_cert``/``tls_key`` (and, with ``tls_client_ca``,
    requiring client certificates signed by it), else plain. Returns whether TLS is on."""
    _check_tls_files(tls_cert, tls_key, tls_client_ca)
    credentials = None
    if tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(_read(tls_key, "TLS key"), _read(tls_cert, "TLS certificate"))],
            root_certificates=_read(tls_client_ca, "TLS client CA") if tls_client_ca else None,
            require_client_auth=bool(tls_client_ca),
        )
    try:  # grpcio reports a port it cannot bind by returning 0 or, in newer releases, by raising RuntimeError
        bound = server.add_secure_port(listen, credentials) if tls_cert else server.add_insecure_port(listen)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise InvalidInput(f"cannot listen on {listen}: the address is in use or not this host's")
    return bool(tls_cert)


def server_ssl_context(tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "") -> ssl.SSLContext | None:
    """What ``bind`` makes of the same files, for a plain server socket: None without a certificate."""
    _check_tls_files(tls_cert, tls_key, tls_client_ca)
    if not tls_cert:
        return None
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls_cert, tls_key)
        if tls_client_ca:
            context.load_verify_locations(tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(f"cannot load the TLS files {tls_cert}, {tls_key}: {exc}") from None
    return context
