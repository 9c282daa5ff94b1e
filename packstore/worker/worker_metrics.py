"""Prometheus metrics of the worker, per namespace where a tenant's activity shows (served by serving/metrics_http.py).

Series of a tenant carry a ``namespace`` label: its calls and their latency, where the packs its answers needed came
from (the label ``tier``: ``device`` LRU hits, ``host`` cache hits, ``store`` reads), and what it holds in each ready
cache (packs, bytes, evictions; the label keeps its name, ``tier``, for dashboards). The caches' limits are the whole
worker's (the namespaces share them) and carry no ``namespace``, so only an operator's token reads them over the
metrics port; each caller reads its own share in ``Status``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from packstore.answering.ready_caches import ReadyCache


class ReadyCacheCollector(Collector):
    """The ready caches' series, read at each scrape from the caches' own counts and the store reads per namespace."""

    def __init__(self, caches: Mapping[str, ReadyCache], store_reads: Callable[[], Mapping[str, int]]) -> None:
        self.caches, self.store_reads = caches, store_reads  # by the label's value ("device", "host"), those in use

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily, GaugeMetricFamily]:
        labels = ["namespace", "tier"]
        return (
            CounterMetricFamily(
                "packstore_worker_pack_reads", "Packs answers took, by namespace and where from: device LRU, host cache or store",
                labels=labels,
            ),
            GaugeMetricFamily("packstore_worker_tier_packs", "Packs held in each tier, by namespace", labels=labels),
            GaugeMetricFamily("packstore_worker_tier_bytes", "Decoded KV bytes held in each tier, by namespace", labels=labels),
            CounterMetricFamily("packstore_worker_tier_evictions", "Packs each tier evicted, by namespace", labels=labels),
            GaugeMetricFamily(
                "packstore_worker_tier_limit_bytes", "Each tier's bound in decoded KV bytes, all namespaces together", labels=["tier"]
            ),
        )

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        reads, packs, size, evictions, limits = self._families()
        for tier, cache in self.caches.items():  # tier: the label's value
            limits.add_metric([tier], cache.limit_bytes)
            for namespace, counts in sorted(cache.counts().items()):
                reads.add_metric([namespace, tier], counts.hits)
                packs.add_metric([namespace, tier], counts.packs)
                size.add_metric([namespace, tier], counts.bytes)
                evictions.add_metric([namespace, tier], counts.evictions)
        for namespace, count in sorted(self.store_reads().items()):
            reads.add_metric([namespace, "store"], count)
        yield from (reads, packs, size, evictions, limits)


class WorkerMetrics:
    """The worker's registry: calls per namespace, method and code, their latency, and the ready caches (``ReadyCacheCollector``)."""

    def __init__(self, caches: Mapping[str, ReadyCache], store_reads: Callable[[], Mapping[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "packstore_worker_requests", "Worker calls finished, by namespace, method and status code", ["namespace", "method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "packstore_worker_request_seconds", "Worker call latency (a whole generation for Generate), by namespace and method",
            ["namespace", "method"], registry=self.registry,
        )
        self.registry.register(ReadyCacheCollector(caches, store_reads))

    def record(self, namespace: str, method: str, code: str, seconds: float) -> None:
        """Count and time one finished call (``namespace`` empty when it was refused before it had one)."""
        self.requests.labels(namespace, method, code).inc()
        self.latency.labels(namespace, method).observe(seconds)
