"""A gRPC channel to one server, shared by the store client and the worker client."""

from __future__ import annotations

from typing import Callable, TypeVar

import grpc

from packstore.errors import InvalidInput, PackstoreError
from packstore.rpc.status import error_from_rpc

GRPC_SCHEME = "grpc://"
MAX_MESSAGE_BYTES = 64 << 20
T = TypeVar("T")


class GrpcClient:
    """A channel to one server, closed with the client; failed calls raise the server's packstore error."""

    what = "server"

    def __init__(self, target: str, *, timeout: float | None = None) -> None:
        self.address = target.removeprefix(GRPC_SCHEME)
        if not self.address or ":" not in self.address:
            raise InvalidInput(f"bad address {target!r}: use HOST:PORT (or grpc://HOST:PORT)")
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
        )

    def close(self) -> None:
        self._channel.close()

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
