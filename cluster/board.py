"""Where engine replicas report their gauges, so the ingress can aggregate them with per-replica labels.

A Serve handle routes each call to one replica of its choice and cannot address a given replica, so the
replicas push: each sends a ``ReplicaReport`` every ``interval_s`` to one named Ray actor per application
(the board). A replica that stops reporting for ``stale_s`` (dead, or restarting) drops out of the totals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.serving.metrics import ServerStats


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's state at ``at`` (unix s); ``actor`` is its Ray actor name (namespace "serve")."""

    replica: str
    actor: str
    node: str
    ready: bool
    healthy: bool
    stats: ServerStats
    at: float


class ReplicaBoard:
    """The latest report of every replica (run as a Ray actor: ``ray.remote(ReplicaBoard)``)."""

    def __init__(self, stale_s: float):
        if stale_s <= 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s}")
        self.stale_s = stale_s
        self._latest: dict[str, ReplicaReport] = {}

    def report(self, report: ReplicaReport) -> None:
        self._latest[report.replica] = report

    def forget(self, replica: str) -> None:
        """A replica shutting down cleanly leaves at once instead of after ``stale_s``."""
        self._latest.pop(replica, None)

    def reports(self) -> list[ReplicaReport]:
        """The fresh reports, oldest replica id first; stale ones are dropped for good."""
        cutoff = time.time() - self.stale_s
        self._latest = {k: r for k, r in self._latest.items() if r.at >= cutoff}
        return sorted(self._latest.values(), key=lambda r: r.replica)


def board_name(app_name: str) -> str:
    return f"cosystream-board-{app_name}"
