"""Prometheus metrics of the worker, per namespace where a tenant's activity shows (served by serving/metrics_http.py).

Series of a tenant carry a ``namespace`` label: its calls and their latency, where the packs its answers needed came
from (the label ``tier``: ``device`` LRU hits, ``host`` cache hits, ``store`` reads), and what it holds in each ready
cache (packs, bytes, evictions; the label keeps its name, ``tier``, for dashboards). The caches' limits are the whole
worker's (the namespaces share them) and carry no ``namespace``, so only an operator's token reads them over the
metrics port; each caller reads its own share in ``Status``. So are the decoder's host buffers' waits and fallbacks
(``BufferCollector``: the pinned staging pool and the pack memory, shared by every namespace).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from packstore.answering.ready_caches import ReadyCache
from packstore.packs.buffers import BufferStats


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


class BufferCollector(Collector):
    """The decoder's host buffers (``HostBuffers.stats``), read at each scrape: requests for pinned staging that waited
    for a copy in flight to give a block back (count, seconds), and what was served outside the pinned pool or the
    pack memory (``kind``: ``pool``, ``memory``; count, bytes). The whole worker's: no ``namespace``."""

    def __init__(self, stats: Callable[[], BufferStats]) -> None:
        self.stats = stats

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return (
            CounterMetricFamily("packstore_worker_buffer_pool_waits", "Staging requests that waited for a pinned pool block to come back"),
            CounterMetricFamily("packstore_worker_buffer_pool_wait_seconds", "Seconds staging requests waited for a pinned pool block"),
            CounterMetricFamily(
                "packstore_worker_buffer_fallbacks",
                "Host buffers served outside their pool (pool: a pinned allocation of its own; memory: pageable memory)", labels=["kind"],
            ),
            CounterMetricFamily(
                "packstore_worker_buffer_fallback_bytes", "Bytes of host buffers served outside their pool", labels=["kind"]
            ),
        )

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        waits, waited, fallbacks, fallback_bytes = self._families()
        now = self.stats()
        waits.add_metric([], now.pool_waits)
        waited.add_metric([], now.pool_wait_seconds)
        by_kind = (("pool", now.pool_fallbacks, now.pool_fallback_bytes), ("memory", now.memory_fallbacks, now.memory_fallback_bytes))
        for kind, count, size in by_kind:
            fallbacks.add_metric([kind], count)
            fallback_bytes.add_metric([kind], size)
        yield from (waits, waited, fallbacks, fallback_bytes)


class WorkerMetrics:
    """The worker's registry: calls per namespace, method and code, their latency, the ready caches (``ReadyCacheCollector``)
    and, given ``buffers`` (the decoder's ``HostBuffers.stats``), its host buffers' waits and fallbacks (``BufferCollector``)."""

    def __init__(
        self,
        caches: Mapping[str, ReadyCache],
        store_reads: Callable[[], Mapping[str, int]],
        buffers: Callable[[], BufferStats] | None = None,
    ) -> None:
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
        if buffers is not None:
            self.registry.register(BufferCollector(buffers))

    def record(self, namespace: str, method: str, code: str, seconds: float) -> None:
        """Count and time one finished call (``namespace`` empty when it was refused before it had one)."""
        self.requests.labels(namespace, method, code).inc()
        self.latency.labels(namespace, method).observe(seconds)
