"""How the cluster is laid out: replica counts, the resources each replica takes, how often it reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

APP_NAME = "cosystream"


@dataclass(frozen=True)
class ClusterConfig:
    """``replicas`` fixed engine replicas, or ``min_replicas..max_replicas`` under Serve's autoscaler when
    ``max_replicas`` is set. ``gpus_per_replica`` 1 on GPU hosts (one whole engine per GPU), 0 on CPU;
    ``cpus_per_replica`` is what Ray reserves for each engine's host-side threads."""

    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    gpus_per_replica: float = 1.0
    cpus_per_replica: float = 1.0
    report_interval_s: float = 0.5  # replica -> board; /metrics and the UI panel lag by at most this
    stale_s: float = 5.0  # a replica silent this long is left out of the totals
    app_name: str = APP_NAME

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.min_replicas < 1:
            raise ValueError(f"replicas and min_replicas must be >= 1: {self.replicas}, {self.min_replicas}")
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} is below min_replicas {self.min_replicas}")
        if self.gpus_per_replica < 0 or self.cpus_per_replica < 0:
            raise ValueError("gpus_per_replica and cpus_per_replica must be >= 0")
        if not 0 < self.report_interval_s < self.stale_s:
            raise ValueError(
                f"need 0 < report_interval_s ({self.report_interval_s}) < stale_s ({self.stale_s})"
            )

    def scaling(self) -> dict[str, Any]:
        """The engine deployment's replica options for ``serve.deployment(...).options``."""
        if self.max_replicas is None:
            return {"num_replicas": self.replicas}
        bounds = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas}
        return {"autoscaling_config": bounds | {"initial_replicas": self.min_replicas}}
