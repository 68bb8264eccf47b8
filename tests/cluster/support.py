"""A local Ray serving the application on 127.0.0.1 (two demo-tiny CPU replicas), and ways to look at it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cluster.board import ReplicaReport, board_name
from cluster.settings import ClusterConfig
from engine.config import EngineConfig, Limits
from tests.conftest import WAIT_S

REPO = Path(__file__).resolve().parents[2]
APP = "test"
LIMITS = Limits(max_concurrency=2, max_queue=2, max_text_chars=2000)
SHORT = "Hello there."  # ~2 s of audio on the tiny model
LONG = "Hello there, this sentence keeps the stream going. " * 8  # minutes of tokens: it runs until stopped


@dataclass(frozen=True)
class Cluster:
    url: str
    board: Any  # the ReplicaBoard actor

    def reports(self) -> list[ReplicaReport]:
        import ray

        return list(ray.get(self.board.reports.remote()))

    def replica_counters(self, name: str) -> dict[str, float]:
        """``cosystream_replica_<name>`` from the ingress's /metrics, by replica id."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        family = f"cosystream_replica_{name}"
        return {
            s.labels["replica"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == family
            for s in f.samples
            if not s.name.endswith("_created")
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_cluster(model_dir: Path, voices_dir: Path) -> Iterator[Cluster]:
    """Ray limited to 2 CPUs (the machine is shared), Serve's proxy on a free port; all shut down after."""
    import ray
    from ray import serve

    from cluster.application import application, fast_path, slow_host_tolerance

    port = free_port()
    slow_host_tolerance()
    fast_path()  # the serving mode app.py --replicas runs: HAProxy, direct ingress, gRPC between replicas
    env = {"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="cosystream", runtime_env=env)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = EngineConfig(
            model=str(model_dir), device="cpu", backend="native", voices_dir=str(voices_dir), limits=LIMITS
        )
        layout = ClusterConfig(
            replicas=2, gpus_per_replica=0, cpus_per_replica=0.5, report_interval_s=0.2, stale_s=2.0,
            app_name=APP,
        )  # fmt: skip
        serve.run(application(cfg, layout, ui_lang="en", api_key=""), name=APP, route_prefix="/")
        cluster = Cluster(f"http://127.0.0.1:{port}", ray.get_actor(board_name(APP), namespace="cosystream"))
        assert wait_until(lambda: len(cluster.reports()) == 2), "the replicas never reported"
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()
