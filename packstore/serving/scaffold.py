"""The scaffold both packstore gRPC servers run on, ``packstore serve``'s PackStore service and the worker sidecar:
JSON log lines, a thread-pool server with the standard health service and reflection, its port bound plain or TLS,
and its life: SIGTERM/SIGINT stop it gracefully, SIGHUP reads the tokens file again."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from packstore.errors import PackstoreError
from packstore.security.auth import Auth
from packstore.serving.listen import bind

# Python runs signal handlers on the main thread only, between bytecodes; a signal the kernel delivers to another
# thread (gRPC's, boto3's) does not wake a main thread blocked on a lock, so it waits with a timeout and looks again.
SIGNAL_POLL_SECONDS = 0.5
CHEAP_THREADS = 8  # threads beyond ``workers`` that only cheap calls (stats, lists, status, health) find free
# Keepalive: the server pings a connection idle for KEEPALIVE_SECONDS and drops it if no answer comes within
# KEEPALIVE_TIMEOUT_SECONDS, so a peer that vanished (a host gone, a cable pulled) frees its streams; clients
# may ping as often as every MIN_CLIENT_PING_SECONDS, also between calls.
KEEPALIVE_SECONDS = 60
KEEPALIVE_TIMEOUT_SECONDS = 20
MIN_CLIENT_PING_SECONDS = 10
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_SECONDS * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_SECONDS * 1000),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_SECONDS * 1000),
)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, message, and any structured fields passed in ``extra``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        entry.update(getattr(record, "fields", {}))
        return json.dumps(entry, ensure_ascii=False)


def log_as_json(level: str) -> None:
    """Send every log record from ``level`` up to stderr, one JSON object per line (``JsonLogFormatter``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class Server:
    """A gRPC server on a pool of ``workers`` threads, and CHEAP_THREADS more that calls holding no transfer share
    always find (the services' share rules keep transfers to ``workers``), with keepalive, one packstore service
    (``service_name``, registered by ``add_service``), the standard health service and reflection (both open to
    callers without a token: they reveal no data), bound to ``listen``: TLS with ``tls_cert``/``tls_key`` (mutual
    with ``tls_client_ca``), else plain.
    ``log``: the server's own logger, for its start, reloads and shutdown."""

    def __init__(
        self,
        service_name: str,
        add_service: Callable[[grpc.Server], None],
        listen: str,
        *,
        log: logging.Logger,
        workers: int,
        max_concurrent_rpcs: int | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls_cert: str = "",
        tls_key: str = "",
        tls_client_ca: str = "",
    ) -> None:
        self.service_name, self.log = service_name, log
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers + CHEAP_THREADS),
            options=[*KEEPALIVE_OPTIONS, *options],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        add_service(self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc)
        self.tls = bind(self.grpc, listen, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)

    def run(self, auth: Auth, grace_seconds: float, fields: dict[str, Any], *, stopping: Callable[[], None] | None = None) -> None:
        """Take calls, report SERVING, log ``serving`` with ``fields``, and serve until SIGTERM/SIGINT (SIGHUP reloads
        ``auth``'s tokens); then health turns NOT_SERVING, ``stopping`` runs, new calls are refused and the calls in
        flight (streams included) get up to ``grace_seconds`` to finish. Call from the main thread (it sets signals)."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        signal.signal(signal.SIGHUP, lambda *_: self.reload_tokens(auth))
        self.grpc.start()
        for name in ("", self.service_name):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.log.info("serving", extra={"fields": fields})
        while not stop.wait(SIGNAL_POLL_SECONDS):
            pass
        self.log.info("shutting down", extra={"fields": {"grace_seconds": grace_seconds}})
        self.health.enter_graceful_shutdown()
        if stopping is not None:
            stopping()
        self.grpc.stop(grace_seconds).wait()
        self.log.info("stopped")

    def reload_tokens(self, auth: Auth) -> None:
        """SIGHUP: read the tokens file again; if it does not parse, keep the tokens in force and say why."""
        try:
            self.log.info("tokens reloaded", extra={"fields": {"tokens": auth.reload()}})
        except PackstoreError as exc:
            self.log.error("tokens not reloaded, the previous ones stay in force", extra={"fields": {"error": str(exc)}})
