"""/metrics on the ingress: one labelled sample per replica and gauge."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.board import ReplicaReport
from cluster.metrics import ReplicaCollector
from engine.serving.metrics import ServerStats


class Source:
    def __init__(self, reports: list[ReplicaReport]):
        self.reports = reports

    def replicas(self) -> list[ReplicaReport]:
        return self.reports


def samples(source: Source) -> dict[str, dict[tuple[str, str], float]]:
    reg = CollectorRegistry()
    reg.register(ReplicaCollector(source))  # type: ignore[arg-type]
    out: dict[str, dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in family.samples:
            key = (s.labels.get("replica", ""), s.labels.get("node", ""))
            out.setdefault(s.name, {})[key] = s.value
    return out


def test_each_replica_is_a_labelled_sample() -> None:
    a = ReplicaReport(
        "r1", "act1", "host-a", True, True, ServerStats(2, 1, completed=5, audio_s_total=9.5), 0
    )
    b = ReplicaReport("r2", "act2", "host-b", False, True, ServerStats(0, 0, failed=1), 0)
    got = samples(Source([a, b]))
    assert got["cosystream_replicas"] == {("", ""): 2.0}
    assert got["cosystream_replica_active_streams"] == {("r1", "host-a"): 2.0, ("r2", "host-b"): 0.0}
    assert got["cosystream_replica_queue_depth"][("r1", "host-a")] == 1.0
    assert got["cosystream_replica_ready"] == {("r1", "host-a"): 1.0, ("r2", "host-b"): 0.0}
    assert got["cosystream_replica_completed_total"][("r1", "host-a")] == 5.0
    assert got["cosystream_replica_failed_total"][("r2", "host-b")] == 1.0
    assert got["cosystream_replica_audio_seconds_total"][("r1", "host-a")] == 9.5


def test_no_replicas_reporting_is_zero_not_an_error() -> None:
    got = samples(Source([]))
    assert got["cosystream_replicas"] == {("", ""): 0.0}
    assert "cosystream_replica_active_streams" not in got
