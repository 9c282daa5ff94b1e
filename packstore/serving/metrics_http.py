"""The Prometheus port of a packstore server, by one set of rules for every server that opens one.

prometheus_client's own WSGI app (text or OpenMetrics, gzip, ``name[]``) on wsgiref's HTTP server, with a bounded pool:
- at most ``connections`` scrapes at once, ``per_peer`` from one host (serving/connections.py), each on one of as many
  threads; a connection past the caps is refused at once on the accepting thread (503; with TLS, closed);
- an address without a host (``:9100``, ``9100``) listens on loopback, never on every interface;
- with the server's TLS files the port speaks TLS (and requires client certificates with a client CA);
- with tokens (``Auth`` enabled) a scrape needs ``Authorization: Bearer TOKEN`` of the tokens file (else 401): a
  token with ``"*"`` reads every series; any other only the series labelled with one of its namespaces.
"""

from __future__ import annotations

import copy
import logging
import queue
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric

from packstore.errors import InvalidInput
from packstore.security.auth import ANY_NAMESPACE, Auth, bearer_secret
from packstore.security.shares import Shares
from packstore.serving.connections import METRICS_CONNECTIONS, METRICS_CONNECTIONS_PER_PEER, connection_shares, peer_principal, refusal

LOOPBACK = "127.0.0.1"
NAMESPACE_LABEL = "namespace"
REQUEST_SECONDS = 10.0  # a scrape's connection may take this long between bytes, TLS handshake included
UNAUTHORIZED = b"metrics need 'Authorization: Bearer <token>' with a token of the server's tokens file\n"
log = logging.getLogger("packstore.metrics")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def metrics_address(address: str, what: str = "metrics") -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` as (host, port); no host means loopback, so the port is never opened to
    every interface unless asked for (``0.0.0.0:PORT``). ``what``: the port's use, for the error (the worker's HTTP
    API listens by the same rules)."""
    host, _, port = address.rpartition(":")
    number = int(port) if port.isdigit() else -1
    if not 0 <= number <= 65535:
        raise InvalidInput(f"{what} address {address!r}: use HOST:PORT, :PORT or PORT")
    return host.strip("[]") or LOOPBACK, number


class NamespaceView:
    """What a tenant's token reads of a registry: the samples whose ``namespace`` label is one of ``namespaces``;
    series of the whole server (without that label) are left out."""

    def __init__(self, source: CollectorRegistry, namespaces: frozenset[str], names: frozenset[str] | None = None) -> None:
        self.source, self.namespaces, self.names = source, namespaces, names  # names: only these series (None: all)

    def collect(self) -> Iterator[Metric]:
        source = self.source if self.names is None else self.source.restricted_registry(self.names)
        for family in source.collect():
            samples = [sample for sample in family.samples if sample.labels.get(NAMESPACE_LABEL) in self.namespaces]
            if samples:
                kept = copy.copy(family)
                kept.samples = samples
                yield kept

    def restricted_registry(self, names: Iterable[str]) -> NamespaceView:
        """The same view of only the series ``names`` (prometheus_client's ``name[]`` query)."""
        return NamespaceView(self.source, self.namespaces, frozenset(names))


def metrics_app(registry: CollectorRegistry, auth: Auth) -> WsgiApp:
    """The WSGI app serving ``registry``: to anyone without tokens; with them, to a known bearer token, scoped to
    its namespaces (a 401 for no token or an unknown one)."""
    everything = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not auth.enabled:
            return everything(environ, start_response)
        secret = bearer_secret(environ.get("HTTP_AUTHORIZATION", ""))
        token = auth.token_of(secret) if secret else None
        if token is None:
            log.debug(
                "metrics scrape refused",
                extra={"fields": {"peer": environ.get("REMOTE_ADDR"), "token": "none" if secret is None else "unknown"}},
            )
            start_response(
                "401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", 'Bearer realm="packstore"')]
            )
            return [UNAUTHORIZED]
        if ANY_NAMESPACE in token.namespaces:
            return everything(environ, start_response)
        return make_wsgi_app(NamespaceView(registry, frozenset(token.namespaces)))(environ, start_response)

    return app


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's request handler, without a log line per scrape."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class MetricsServer(WSGIServer):
    """Scrapes on a fixed pool of threads, one per connection slot (``shares``): a connection the slots refuse is
    answered 503 and closed on the accepting thread at once (with TLS closed, as no handshake is made for it), so no
    number of connections holds more threads than the slots. With ``tls`` the handshake runs on the scrape's thread,
    under the same timeout, so a client that never finishes it holds only its own slot, never the accepting thread."""

    tls: ssl.SSLContext | None = None
    request_queue_size = socket.SOMAXCONN  # (socketserver's 5 would drop connections under a flood before they are refused)

    def serve_on(self, shares: Shares) -> None:
        """Serve on a daemon thread, with a daemon thread for each of ``shares``' slots."""
        self.shares, self.admitted = shares, queue.SimpleQueue[tuple[socket.socket, Any, str]]()
        for number in range(shares.rule.capacity):
            threading.Thread(target=self._scrapes, name=f"packstore-metrics-{number}", daemon=True).start()
        threading.Thread(target=self.serve_forever, name="packstore-metrics", daemon=True).start()

    @property
    def listening(self) -> str:
        """HOST:PORT where it listens (``server_address`` without an IPv6 address's flow and scope)."""
        host, port = self.socket.getsockname()[:2]
        return f"{host}:{port}"

    def process_request(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        """On the accepting thread: hand the connection to a free thread, or refuse it at once."""
        principal = peer_principal(client_address)
        if self.shares.try_take(principal):
            self.admitted.put((request, client_address, principal))
            return
        log.debug("metrics connection refused", extra={"fields": {"peer": str(client_address)}})
        if self.tls is None:
            request.setblocking(False)
            try:
                request.send(refusal(self.shares.refusal(principal, "metrics connection")))
            except OSError:  # (its buffer full, or the client gone: it is closed all the same)
                pass
        self.shutdown_request(request)

    def _scrapes(self) -> None:
        while True:
            request, client_address, principal = self.admitted.get()
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                self.shares.give_back(principal)

    # (typeshed types BaseServer's request for UDP servers too; a TCP server's is its connection's socket)
    def finish_request(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        request.settimeout(REQUEST_SECONDS)
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        with self.tls.wrap_socket(request, server_side=True) as secure:
            super().finish_request(secure, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed handshake, a timeout or a client gone: logged at debug only, as nobody known made the request."""
        log.debug("metrics request failed", exc_info=True, extra={"fields": {"peer": str(client_address)}})


class MetricsServer6(MetricsServer):
    address_family = socket.AF_INET6


def serve_metrics(
    address: str, registry: CollectorRegistry, auth: Auth, tls: ssl.SSLContext | None = None, *,
    connections: int = METRICS_CONNECTIONS, per_peer: int = METRICS_CONNECTIONS_PER_PEER,
) -> MetricsServer:
    """Serve ``registry`` at ``address`` on daemon threads, by the rules above (at most ``connections`` scrapes at
    once, ``per_peer`` from one host); returns the server (``server_address`` is where it listens). InvalidInput when
    the address or the caps are malformed, or the address cannot be listened on."""
    host, port = metrics_address(address)
    shares = connection_shares("metrics connections", connections, per_peer)
    try:
        server = (MetricsServer6 if ":" in host else MetricsServer)((host, port), _QuietHandler)
    except OSError as exc:
        raise InvalidInput(f"cannot listen on {host}:{port} for metrics: {exc.strerror or exc}") from None
    server.set_app(metrics_app(registry, auth))
    server.tls = tls
    server.serve_on(shares)
    return server
