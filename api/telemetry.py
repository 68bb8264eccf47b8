"""Prometheus metrics of one API instance, in its own ``CollectorRegistry`` (tests build several apps).

Per-request figures (TTFA, RTF, queue wait, LM tokens/s) are observed by the speech route as chunks pass;
server gauges (active streams, queue depth, device memory, totals) are read from ``engine.stats()`` at
scrape time so they also cover streams the UI started.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.serving.metrics import RequestMetrics

TTFA_BUCKETS_S = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
TOKENS_PER_S_BUCKETS = (10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400)
QUEUE_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineCollector:
    """Reads ``engine.stats()`` (a ``ServerStats``) on every scrape."""

    def __init__(self, engine: Any):
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # values only exist at scrape time; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield GaugeMetricFamily(
            "cosystream_ready", "1 when the model is loaded and warm", bool(self.engine.ready)
        )
        yield GaugeMetricFamily("cosystream_active_streams", "streams computing now", stats.active_streams)
        yield GaugeMetricFamily("cosystream_queue_depth", "requests waiting for a slot", stats.queued)
        memory = GaugeMetricFamily(
            "cosystream_device_memory_bytes", "device memory in use", labels=["device"]
        )
        memory.add_metric([stats.device], stats.device_memory_mb * 2**20)
        yield memory
        yield CounterMetricFamily("cosystream_engine_completed", "requests completed", stats.completed)
        yield CounterMetricFamily("cosystream_engine_failed", "requests failed", stats.failed)
        yield CounterMetricFamily("cosystream_audio_seconds", "audio produced (s)", stats.audio_s_total)
        yield CounterMetricFamily("cosystream_lm_tokens", "speech tokens generated", stats.lm_tokens_total)


class Telemetry:
    """The API's metrics; ``exposition()`` is the ``/metrics`` body."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "cosystream_http_requests",
            "API requests by route and status",
            ["endpoint", "status"],
            registry=reg,
        )
        self.ttfa = Histogram(
            "cosystream_ttfa_seconds", "time to first audio", buckets=TTFA_BUCKETS_S, registry=reg
        )
        self.rtf = Histogram(
            "cosystream_rtf", "compute s / audio s per request", buckets=RTF_BUCKETS, registry=reg
        )
        self.queue_wait = Histogram(
            "cosystream_queue_wait_seconds", "wait for a slot", buckets=QUEUE_BUCKETS_S, registry=reg
        )
        self.lm_tokens_per_s = Histogram(
            "cosystream_lm_tokens_per_second", "LM decode rate", buckets=TOKENS_PER_S_BUCKETS, registry=reg
        )
        self.api_streams = Gauge("cosystream_api_streams_active", "API responses streaming now", registry=reg)
        self.disconnects = Counter("cosystream_client_disconnects", "streams the client left", registry=reg)
        self.stream_errors = Counter(
            "cosystream_stream_errors", "streams failed after the headers", registry=reg
        )
        reg.register(EngineCollector(engine))  # type: ignore[arg-type]  # duck-typed Collector

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def first_audio(self, metrics: RequestMetrics) -> None:
        if metrics.ttfa_ms is not None:
            self.ttfa.observe(metrics.ttfa_ms / 1000.0)
        self.queue_wait.observe(metrics.queue_wait_ms / 1000.0)

    def finished(self, metrics: RequestMetrics) -> None:
        if metrics.rtf is not None:
            self.rtf.observe(metrics.rtf)
        if metrics.lm_tokens_per_s > 0:
            self.lm_tokens_per_s.observe(metrics.lm_tokens_per_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
