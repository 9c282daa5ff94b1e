"""Prometheus metrics of the service, served on their own port."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_log = logging.getLogger("packstore.service")


class ServiceMetrics:
    """Requests, bytes, latencies and errors per method, and the store's size."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("packstore_requests", "RPCs finished, by method and status code", ["method", "code"], registry=self.registry)
        self.latency = Histogram("packstore_request_seconds", "RPC latency, by method", ["method"], registry=self.registry)
        self.bytes_sent = Counter("packstore_sent_bytes", "Pack bytes streamed to clients", registry=self.registry)
        self.bytes_received = Counter("packstore_received_bytes", "Pack bytes received from clients", registry=self.registry)
        self.store_packs = Gauge("packstore_store_packs", "Packs in the store", registry=self.registry)
        self.store_pack_bytes = Gauge("packstore_store_pack_bytes", "Stored bytes of every pack (headers and chunks)", registry=self.registry)
        self.store_bytes = Gauge("packstore_store_file_bytes", "Size of the store's data file", registry=self.registry)
        self.hot_packs = Gauge("packstore_hot_packs", "Packs held hot in memory for the bulk port", registry=self.registry)
        self.hot_bytes = Gauge("packstore_hot_bytes", "Stored bytes of the packs held hot", registry=self.registry)
        self.hot_reads = Counter("packstore_hot_reads", "Bulk transfers, by namespace and whether their pack was hot there", ["namespace", "result"], registry=self.registry)
        self.bulk_refused = Counter(
            "packstore_bulk_refused", "Bulk connections turned away before a valid ticket, by reason", ["reason"], registry=self.registry
        )

    def record(self, method: str, code: str, seconds: float, fields: dict) -> None:
        """Count, time and log one finished call (an RPC or a bulk transfer): logged at INFO when ``code`` is
        OK, else WARNING, with ``fields`` (never a token, only its name)."""
        self.requests.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)
        level = logging.INFO if code == "OK" else logging.WARNING
        _log.log(level, method, extra={"fields": {"method": method, "code": code, "ms": round(seconds * 1000, 2), **fields}})

    def serve(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)
