"""The worker's HTTP connections, guarded below uvicorn: a cap on them (in all and per host, serving/connections.py),
and a deadline and a size bound on each request's head, which uvicorn has neither of (without them a client sending
its headers a byte at a time keeps its connection, and the worker's memory, as long as it likes).

``ConnectionGuard.protocol()`` is the class uvicorn is given as its HTTP protocol (``uvicorn.Config(http=...)``): each
connection's own uvicorn protocol (``AutoHTTPProtocol``, httptools else h11) sits inside one, which sees its bytes
first; ``ConnectionGuard.app`` wraps the ASGI app to learn when a connection's response is over. Nothing of uvicorn's
protocol beyond asyncio's ``Protocol`` interface is used, so its internals may change freely.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from packstore.serving.connections import connection_shares, peer_principal, refusal

MAX_HEADER_BYTES = 64 << 10  # a request line and headers past this close the connection
HEAD_END = b"\r\n\r\n"
log = logging.getLogger("packstore.worker")


class ConnectionGuard:
    """The connections of one HTTP port: ``shares`` (``capacity``, ``per_peer``), each head within ``header_seconds``
    of the connection or of its last response (else closed), the open ones by client address."""

    def __init__(self, capacity: int, per_peer: int, header_seconds: float) -> None:
        self.shares = connection_shares("HTTP connections", capacity, per_peer)
        self.header_seconds = header_seconds
        self.open: dict[tuple[str, int], GuardedConnection] = {}

    def protocol(self) -> type[asyncio.Protocol]:
        """The protocol class for ``uvicorn.Config(http=...)``."""
        return type("GuardedHTTPProtocol", (GuardedConnection,), {"guard": self})

    def app(self, app: ASGIApp) -> ASGIApp:
        """``app``, telling each connection when a request of it is answered and when that is over (its next head's
        deadline starts)."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            client = scope.get("client")
            connection = self.open.get((str(client[0]), int(client[1]))) if client else None
            if connection is not None:
                connection.answering()
            try:
                await app(scope, receive, send)
            finally:
                if connection is not None:
                    connection.answered()

        return guarded


class GuardedConnection(asyncio.Protocol):
    """One connection: refused at once past the caps, else served by uvicorn's protocol (``inner``) while its heads
    keep within their deadline and size."""

    guard: ConnectionGuard

    def __init__(self, **uvicorn_arguments: Any) -> None:
        self.inner = AutoHTTPProtocol(**uvicorn_arguments)
        self.transport: asyncio.Transport | None = None
        self.principal: str | None = None  # the host holding a connection slot, once admitted
        self.address: tuple[str, int] | None = None
        self.in_head = True  # the bytes coming are a request's head (not a body, not while a request is answered)
        self.head_bytes = 0
        self.tail = b""  # the last bytes of the head so far, to find its end across reads
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # (uvloop's is one in all but its class)
        peer = transport.get_extra_info("peername")
        principal = peer_principal(peer)
        shares = self.guard.shares
        if not shares.try_take(principal):
            log.debug("HTTP connection refused", extra={"fields": {"peer": str(peer), "held": shares.held(principal)}})
            transport.write(refusal(shares.refusal(principal, "HTTP connection")))
            transport.close()
            return
        self.principal, self.address = principal, (str(peer[0]), int(peer[1]))
        self.guard.open[self.address] = self
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.principal is None:  # (refused: what it sends is dropped with it)
            return
        if self.in_head:
            seen = self.tail + data
            end = seen.find(HEAD_END)
            self.head_bytes += len(data) if end < 0 else max(0, end + len(HEAD_END) - len(self.tail))
            if self.head_bytes > MAX_HEADER_BYTES:
                self._close()
                return
            if end < 0:
                self.tail = seen[-(len(HEAD_END) - 1) :]
            else:  # the head is whole: the request is uvicorn's now, until its response is over
                self.answering()
        self.inner.data_received(data)

    def answering(self) -> None:
        """A request of it is being answered (its head whole, even one that came behind another's body)."""
        self.in_head, self.tail = False, b""
        self._disarm()

    def answered(self) -> None:
        """The response to the request in hand is over: the next head must come within the deadline."""
        if self.principal is not None and self.transport is not None and not self.transport.is_closing():
            self.in_head, self.head_bytes, self.tail = True, 0, b""
            self._arm()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.principal is not None else None

    def pause_writing(self) -> None:
        if self.principal is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.principal is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.principal is None:
            return
        if self.address is not None and self.guard.open.get(self.address) is self:
            del self.guard.open[self.address]
        self.guard.shares.give_back(self.principal)
        self.principal = None
        self.inner.connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.deadline = asyncio.get_running_loop().call_later(self.guard.header_seconds, self._late)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _late(self) -> None:
        self.deadline = None
        if self.in_head:
            self._close()

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
