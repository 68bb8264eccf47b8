"""Per-replica Prometheus series on the ingress's ``/metrics``, beside the API's cluster-wide totals.

Each replica's last report becomes one sample per gauge, labelled ``replica`` (Serve's replica id) and
``node`` (its host), so a dashboard can tell a hot or missing replica from a busy cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.board import ReplicaReport

LABELS = ["replica", "node"]
_Family = GaugeMetricFamily | CounterMetricFamily


class HasReplicas(Protocol):
    def replicas(self) -> list[ReplicaReport]: ...


class ReplicaCollector:
    def __init__(self, source: HasReplicas):
        self.source = source

    def describe(self) -> list[Metric]:
        return []  # values only exist at scrape time

    def collect(self) -> Iterator[Metric]:
        reports = self.source.replicas()
        yield GaugeMetricFamily("cosystream_replicas", "engine replicas reporting", len(reports))
        families = (
            _gauge("ready", "1 when the replica is loaded and warm", lambda r: float(r.ready)),
            _gauge("healthy", "1 while its workers can compute", lambda r: float(r.healthy)),
            _gauge("active_streams", "streams computing now", lambda r: r.stats.active_streams),
            _gauge("queue_depth", "requests waiting for a slot", lambda r: r.stats.queued),
            _gauge("device_memory_bytes", "device memory in use", lambda r: r.stats.device_memory_mb * 2**20),
            _counter("completed", "requests completed", lambda r: r.stats.completed),
            _counter("failed", "requests failed", lambda r: r.stats.failed),
            _counter("cancelled", "requests the caller left", lambda r: r.stats.cancelled),
            _counter("audio_seconds", "audio produced (s)", lambda r: r.stats.audio_s_total),
        )
        for family, value in families:
            for r in reports:
                family.add_metric([r.replica, r.node], value(r))
            yield family


def _gauge(name: str, doc: str, value: _Value) -> tuple[_Family, _Value]:
    return GaugeMetricFamily(f"cosystream_replica_{name}", doc, labels=LABELS), value


def _counter(name: str, doc: str, value: _Value) -> tuple[_Family, _Value]:
    return CounterMetricFamily(f"cosystream_replica_{name}", doc, labels=LABELS), value


class _Value(Protocol):
    def __call__(self, report: ReplicaReport, /) -> float: ...
