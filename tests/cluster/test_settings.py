"""ClusterConfig: replica counts and resources are checked, and become Serve's replica options."""

from __future__ import annotations

import pytest

from cluster.settings import ClusterConfig


def test_fixed_replicas_or_autoscaling_bounds() -> None:
    assert ClusterConfig(replicas=3).scaling() == {"num_replicas": 3}
    auto = ClusterConfig(min_replicas=2, max_replicas=4).scaling()["autoscaling_config"]
    assert auto == {"min_replicas": 2, "max_replicas": 4, "initial_replicas": 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "below min_replicas"),
        ({"gpus_per_replica": -1}, "gpus_per_replica"),
        ({"report_interval_s": 5.0, "stale_s": 5.0}, "report_interval_s"),
    ],
)
def test_bad_layouts_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)  # type: ignore[arg-type]
