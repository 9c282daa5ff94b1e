"""The scaffold both packstore gRPC servers run on, ``packstore serve``'s PackStore service and the worker sidecar:
JSON log lines, an asyncio gRPC server (``grpc.aio``, on an event loop of its own thread) that runs the synchronous
servicer on thread pools only once a call's token and shares are checked (``bridge.py``, ``admission.py``), the
standard health service and reflection, its port bound plain or TLS, and its life: SIGTERM/SIGINT stop it
gracefully, SIGHUP reads the tokens file again."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from packstore.errors import PackstoreError
from packstore.security.auth import Auth
from packstore.serving.admission import CHEAP_THREADS, Admission
from packstore.serving.bridge import Bridge
from packstore.serving.listen import bind

Result = TypeVar("Result")

# Python runs signal handlers on the main thread only, between bytecodes; a signal the kernel delivers to another
# thread (gRPC's, boto3's) does not wake a main thread blocked on a lock, so it waits with a timeout and looks again.
SIGNAL_POLL_SECONDS = 0.5
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


class Registrar:
    """Stands in for the server when generated code registers a servicer: each of its method handlers is added to
    ``server`` as ``wrap`` makes it (the generated code registers the same handlers twice, generic and by name)."""

    def __init__(self, server: grpc.aio.Server, wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]) -> None:
        self.server, self.wrap = server, wrap

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {method: self.wrap(method, handler) for method, handler in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self.server.add_registered_method_handlers(service, wrapped)


class Server:
    """An asyncio gRPC server with keepalive, one packstore service (``service_name``, its synchronous servicer
    registered by ``add_service`` on a ``Registrar``), the standard health service and reflection (both open to
    callers without a token: they reveal no data; each host holds at most its share of them), bound to ``listen``:
    TLS with ``tls_cert``/``tls_key`` (mutual with ``tls_client_ca``), else plain. A call waits for its messages
    on the event loop, holding no thread; once ``admission`` admits it, its handler runs on ``workers`` threads
    (the methods ``admission.heavy``) or on CHEAP_THREADS threads of the cheap calls' own.
    ``log``: the server's own logger, for its start, reloads and shutdown."""

    def __init__(
        self,
        service_name: str,
        add_service: Callable[[Registrar], None],
        listen: str,
        *,
        log: logging.Logger,
        admission: Admission,
        workers: int,
        options: Sequence[tuple[str, Any]] = (),
        tls_cert: str = "",
        tls_key: str = "",
        tls_client_ca: str = "",
    ) -> None:
        self.service_name, self.log, self.admission = service_name, log, admission
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="packstore-grpc-loop", daemon=True)
        self._loop_thread.start()
        self.pools = (
            ThreadPoolExecutor(workers, thread_name_prefix="packstore-transfer"),
            ThreadPoolExecutor(CHEAP_THREADS, thread_name_prefix="packstore-cheap"),
        )
        bridge = Bridge(admission, *self.pools)
        self.health = health.aio.HealthServicer()

        async def build() -> tuple[grpc.aio.Server, bool]:
            server = grpc.aio.server(options=[*KEEPALIVE_OPTIONS, *options])
            add_service(Registrar(server, bridge.wrap))
            anonymous = Registrar(server, bridge.wrap_anonymous)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, anonymous)
            names = [service_name, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(names), anonymous)
            return server, bind(server, listen, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)

        try:
            self.grpc, self.tls = self._on_loop(build())
        except BaseException:
            self._close()
            raise

    def _on_loop(self, work: Coroutine[Any, Any, Result]) -> Result:
        """Run ``work`` on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def start(self) -> None:
        self._on_loop(self.grpc.start())

    def stop(self, grace_seconds: float | None) -> None:
        """Refuse new calls, give those in flight up to ``grace_seconds`` to finish, then end the loop and the pools."""
        self._on_loop(self.grpc.stop(grace_seconds))
        self._close()

    def _close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join()
        self.loop.close()

    def run(self, auth: Auth, grace_seconds: float, fields: dict[str, Any], *, stopping: Callable[[], None] | None = None) -> None:
        """Take calls, report SERVING, log ``serving`` with ``fields``, and serve until SIGTERM/SIGINT (SIGHUP reloads
        ``auth``'s tokens); then health turns NOT_SERVING, ``stopping`` runs, new calls are refused and the calls in
        flight (streams included) get up to ``grace_seconds`` to finish. Call from the main thread (it sets signals)."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        signal.signal(signal.SIGHUP, lambda *_: self.reload_tokens(auth))
        self.start()
        for name in ("", self.service_name):
            self._on_loop(self.health.set(name, health_pb2.HealthCheckResponse.SERVING))
        self.log.info("serving", extra={"fields": fields})
        while not stop.wait(SIGNAL_POLL_SECONDS):
            pass
        self.log.info("shutting down", extra={"fields": {"grace_seconds": grace_seconds}})
        self._on_loop(self.health.enter_graceful_shutdown())
        if stopping is not None:
            stopping()
        self.stop(grace_seconds)
        self.log.info("stopped")

    def reload_tokens(self, auth: Auth) -> None:
        """SIGHUP: read the tokens file again; if it does not parse, keep the tokens in force and say why."""
        try:
            self.log.info("tokens reloaded", extra={"fields": {"tokens": auth.reload()}})
        except PackstoreError as exc:
            self.log.error("tokens not reloaded, the previous ones stay in force", extra={"fields": {"error": str(exc)}})
