"""The replica board keeps each replica's latest report and drops the silent ones."""

from __future__ import annotations

import time

import pytest

from cluster.board import ReplicaBoard, ReplicaReport
from engine.serving.metrics import ServerStats


def report(replica: str, at: float, active: int = 0) -> ReplicaReport:
    return ReplicaReport(replica, f"actor-{replica}", "node", True, True, ServerStats(active), at)


def test_latest_report_per_replica_sorted_by_id() -> None:
    board = ReplicaBoard(stale_s=5.0)
    now = time.time()
    board.report(report("b", now, active=1))
    board.report(report("a", now))
    board.report(report("b", now, active=3))
    assert [(r.replica, r.stats.active_streams) for r in board.reports()] == [("a", 0), ("b", 3)]


def test_silent_and_departed_replicas_drop_out() -> None:
    board = ReplicaBoard(stale_s=5.0)
    now = time.time()
    board.report(report("old", now - 6.0))
    board.report(report("live", now))
    board.report(report("leaving", now))
    board.forget("leaving")
    board.forget("never-seen")  # harmless
    assert [r.replica for r in board.reports()] == ["live"]


def test_stale_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stale_s"):
        ReplicaBoard(stale_s=0)
