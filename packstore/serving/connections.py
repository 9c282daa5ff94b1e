"""Caps on the connections of a server's HTTP ports (the worker's API, a metrics port), so that no peer, nor a few,
can hold them all: at most ``capacity`` at once, at most ``per_peer`` from one host, shared among hosts by the rule of
security/shares.py. A connection past the cap is refused at once where it is accepted (503, OpenAI's error object,
``Connection: close``), holding no thread; and the open files the caps need are made sure of at start.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass

from packstore.errors import InvalidInput
from packstore.security.shares import ShareRule, Shares, principal_key

REFUSED_STATUS = 503
RETRY_SECONDS = 1  # the Retry-After of a refused connection
# the caps' defaults: a metrics port's connections each hold a thread; the worker's HTTP API's only an open file
METRICS_CONNECTIONS, METRICS_CONNECTIONS_PER_PEER = 16, 4
HTTP_CONNECTIONS, HTTP_CONNECTIONS_PER_PEER = 1024, 64
FILES_BESIDE = 512  # open files a server needs beside its capped ports: gRPC connections, stores, the model, pipes


@dataclass(frozen=True)
class ConnectionCaps:
    """The connection caps of a server's HTTP ports, as its settings give them (InvalidInput for one below 1)."""

    metrics: int = METRICS_CONNECTIONS
    metrics_per_peer: int = METRICS_CONNECTIONS_PER_PEER
    http: int = HTTP_CONNECTIONS
    http_per_peer: int = HTTP_CONNECTIONS_PER_PEER

    def __post_init__(self) -> None:
        if min(self.metrics, self.metrics_per_peer, self.http, self.http_per_peer) < 1:
            raise InvalidInput(f"connection caps must be at least 1, got {self}")


def connection_shares(what: str, capacity: int, per_peer: int) -> Shares:
    """The connection slots of one port (``what``, as refusals name them)."""
    return Shares(what, ShareRule.default(capacity, min(per_peer, capacity)))


def peer_of(host: str, port: int) -> str:
    """A client's address written as a gRPC peer is (``ipv4:HOST:PORT``, ``ipv6:%5BHOST%5D:PORT``; empty: unknown)."""
    if not host:
        return ""
    return f"ipv6:%5B{host}%5D:{port}" if ":" in host else f"ipv4:{host}:{port}"


def peer_principal(address: object) -> str:
    """The principal a connection from ``address`` (a socket's peer address) counts for: its host."""
    host, port = (str(address[0]), int(address[1])) if isinstance(address, tuple) and len(address) >= 2 else ("", 0)
    return principal_key("", False, peer_of(host, port))


def refusal(message: str) -> bytes:
    """The whole response of a refused connection, sent before it is closed."""
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "too_many_connections"}}
    body = json.dumps(error).encode()
    head = (
        f"HTTP/1.1 {REFUSED_STATUS} Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Retry-After: {RETRY_SECONDS}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def ensure_open_files(capped: int, what: str) -> int:
    """Make sure this process may open ``capped`` connections plus FILES_BESIDE files: the soft ``RLIMIT_NOFILE``
    raised to the hard limit when it is lower; InvalidInput naming ``what`` (the settings) when even the hard limit is.
    Returns the soft limit now in force."""
    needed = capped + FILES_BESIDE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise InvalidInput(
            f"{what} need {needed} open files ({capped} connections and {FILES_BESIDE} more), but this process may open only "
            f"{hard} (ulimit -Hn): raise the limit (LimitNOFILE= in a systemd unit, the nofile ulimit of a docker container) or lower them"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard
