"""A gRPC channel to one server, shared by the store client and the worker client: plain or TLS
(``grpcs://``, mutual with a client certificate), sending a bearer token and a namespace when set."""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from packstore.errors import InvalidInput, PackstoreError
from packstore.rpc.fields import NAMESPACE_HEADER
from packstore.rpc.status import error_from_rpc

GRPC_SCHEME = "grpc://"
GRPCS_SCHEME = "grpcs://"
MAX_MESSAGE_BYTES = 64 << 20
T = TypeVar("T")


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Connection:
    """How a client reaches a server: TLS files (for ``grpcs://``), the bearer token it sends and the namespace it
    names.

    ``from_env`` fills what is not given from ``$PACKSTORE_TLS_CA``, ``$PACKSTORE_TLS_CLIENT_CERT``,
    ``$PACKSTORE_TLS_CLIENT_KEY``, ``$PACKSTORE_TOKEN`` and ``$PACKSTORE_NAMESPACE``."""

    tls_ca: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    token: str | None = None
    namespace: str | None = None

    @classmethod
    def from_env(cls, *, token_file: str | None = None, **given: str | None) -> Connection:
        values = {name: given.get(name) or os.environ.get(f"PACKSTORE_{name.upper()}") or None for name in cls.__dataclass_fields__}
        contents = _read(token_file, "token file")  # None when no file is named
        if contents is not None:
            token = contents.decode("utf-8", errors="replace").strip()
            if not token:
                raise InvalidInput(f"token file {token_file} is empty")
            values["token"] = token
        return cls(**values)

    def metadata(self) -> list[tuple[str, str]]:
        """What every call sends: ``authorization: Bearer <token>`` and the namespace, when set."""
        found = []
        if self.token:
            found.append(("authorization", f"Bearer {self.token}"))
        if self.namespace:
            found.append((NAMESPACE_HEADER, self.namespace))
        return found

    def _check_client_pair(self) -> None:
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise InvalidInput("a TLS client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials: the CA to trust (else the system's) and, for mutual TLS, the client's certificate."""
        self._check_client_pair()
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "TLS CA"),
            private_key=_read(self.tls_client_key, "TLS client key"),
            certificate_chain=_read(self.tls_client_cert, "TLS client certificate"),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust and client certificate as ``credentials``, for the bulk port's TLS."""
        self._check_client_pair()
        try:
            context = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_client_cert:
                context.load_cert_chain(self.tls_client_cert, self.tls_client_key)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidInput(f"cannot load the TLS files for the bulk port: {exc}") from None
        return context


class _Metadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (token, namespace) to every call of a channel."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        class Details(grpc.ClientCallDetails):
            pass

        found = Details()
        found.method, found.timeout, found.credentials = details.method, details.timeout, details.credentials
        found.wait_for_ready, found.compression = getattr(details, "wait_for_ready", None), getattr(details, "compression", None)
        found.metadata = list(details.metadata or []) + self.metadata
        return found

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class GrpcClient:
    """A channel to one server, closed with the client; failed calls raise the server's packstore error.

    ``target`` is ``HOST:PORT``, ``grpc://HOST:PORT`` or ``grpcs://HOST:PORT`` (TLS with ``connection``'s files).
    """

    what = "server"

    def __init__(self, target: str, *, timeout: float | None = None, connection: Connection | None = None) -> None:
        secure = target.startswith(GRPCS_SCHEME)
        self.address = target.removeprefix(GRPCS_SCHEME).removeprefix(GRPC_SCHEME)
        if not self.address or ":" not in self.address:
            raise InvalidInput(f"bad address {target!r}: use HOST:PORT, grpc://HOST:PORT or grpcs://HOST:PORT")
        self.target = target
        self.timeout = timeout
        self.connection = connection if connection is not None else Connection.from_env()
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        if secure:
            self._raw_channel = grpc.secure_channel(self.address, self.connection.credentials(), options=options)
        else:
            self._raw_channel = grpc.insecure_channel(self.address, options=options)
        metadata = self.connection.metadata()
        self._channel = grpc.intercept_channel(self._raw_channel, _Metadata(metadata)) if metadata else self._raw_channel

    def close(self) -> None:
        self._raw_channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, exc: grpc.RpcError) -> PackstoreError:
        """The packstore error a failed call stands for (the same class and fields as raised on the server)."""
        return error_from_rpc(exc, f"{self.what} at {self.target}")

    def _call(self, invoke: Callable[[], T]) -> T:
        try:
            return invoke()
        except grpc.RpcError as exc:
            raise self._error(exc) from None
