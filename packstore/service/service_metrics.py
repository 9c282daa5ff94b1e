"""Prometheus metrics of the service, per namespace where a tenant's activity shows (served by serving/metrics_http.py).

Every series of a tenant's activity or holdings carries a ``namespace`` label: requests, latencies, pack bytes sent
and received, bulk hot reads, and the store and hot-pack gauges (one series per open namespace). Series of the
whole service (the local files' size, hot memory, bulk connections refused before a ticket) carry none, and calls
refused before they had a namespace (no token, say) count under ``namespace=""``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_log = logging.getLogger("packstore.service")


class NamespaceGauge(Collector):
    """A gauge with one series per namespace, read at each scrape from a function giving {namespace: value}."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._read: Callable[[], Mapping[str, float]] = dict
        registry.register(self)

    def set_function(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=["namespace"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=["namespace"])
        for namespace, value in sorted(self._read().items()):
            family.add_metric([namespace], value)
        yield family


class ServiceMetrics:
    """Requests, bytes, latencies and errors per method and namespace, and what each namespace holds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "packstore_requests", "RPCs finished, by namespace, method and status code", ["namespace", "method", "code"], registry=registry
        )
        self.latency = Histogram(
            "packstore_request_seconds", "RPC latency, by namespace and method", ["namespace", "method"], registry=registry
        )
        self.bytes_sent = Counter("packstore_sent_bytes", "Pack bytes sent to clients, by namespace", ["namespace"], registry=registry)
        self.bytes_received = Counter(
            "packstore_received_bytes", "Pack bytes received from clients, by namespace", ["namespace"], registry=registry
        )
        self.store_packs = NamespaceGauge("packstore_store_packs", "Packs in each open namespace's store", registry)
        self.store_pack_bytes = NamespaceGauge(
            "packstore_store_pack_bytes", "Stored bytes of every pack (headers and chunks), by namespace", registry
        )
        self.store_bytes = Gauge("packstore_store_file_bytes", "Size of the local data files of the open namespaces", registry=registry)
        self.hot_packs = NamespaceGauge("packstore_hot_packs", "Packs held hot in memory for the bulk port, by namespace", registry)
        self.hot_bytes = NamespaceGauge("packstore_hot_bytes", "Stored bytes of the packs held hot, by namespace", registry)
        self.hot_memory = Gauge(
            "packstore_hot_memory_bytes",
            "Memory of the hot packs, writes and transfers in flight included (bounded by --hot-bytes per namespace)",
            registry=registry,
        )
        self.hot_reads = Counter(
            "packstore_hot_reads",
            "Bulk transfers, by namespace and whether their pack was hot there",
            ["namespace", "result"],
            registry=registry,
        )
        self.bulk_refused = Counter(
            "packstore_bulk_refused", "Bulk connections turned away before a valid ticket, by reason", ["reason"], registry=registry
        )

    def record(self, method: str, code: str, seconds: float, fields: dict[str, object]) -> None:
        """Count, time and log one finished call (an RPC or a bulk transfer) under the namespace in ``fields``: logged at
        INFO when ``code`` is OK, else WARNING, with ``fields`` (never a token, only its name)."""
        namespace = fields.get("namespace", "")
        self.requests.labels(namespace, method, code).inc()
        self.latency.labels(namespace, method).observe(seconds)
        level = logging.INFO if code == "OK" else logging.WARNING
        _log.log(level, method, extra={"fields": {"method": method, "code": code, "ms": round(seconds * 1000, 2), **fields}})
