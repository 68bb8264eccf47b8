"""Assemble the Serve application: ``build`` for ``serve deploy`` / ``serve run`` (its ``args`` are the
server's own flags), ``run_local`` for ``python app.py --replicas N`` (a local Ray on this machine).

The engine deployment's ``max_ongoing_requests`` is the engine's concurrency, so Serve's router sends a
request only to a replica with a free slot, picking the less loaded of two; beyond every slot, requests wait
at the ingress's handle, at most ``max_queue`` of them, and the rest get the same 429 + Retry-After.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from ray import serve

from cluster.board import board_name
from cluster.engine_replica import EngineReplica
from cluster.ingress import Ingress, IngressConfig
from cluster.settings import ClusterConfig
from engine.config import DEMO_TINY, EngineConfig

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT = "EngineReplica", "Ingress"  # the names serve_config.yaml uses
HEALTH_CHECK_PERIOD_S = 5.0
INGRESS_MIN_ONGOING = 100  # probes, /metrics and the studio's page loads beside the streams


def application(
    cfg: EngineConfig, cluster: ClusterConfig, *, ui_lang: str = "zh", api_key: str | None = None
) -> Any:
    """The bound application (``serve.run`` it): an ingress over the engine replicas."""
    board = board_name(cluster.app_name)
    engines = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        max_ongoing_requests=cfg.limits.max_concurrency,
        max_queued_requests=cfg.limits.max_queue,
        ray_actor_options={"num_gpus": cluster.gpus_per_replica, "num_cpus": cluster.cpus_per_replica},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        **cluster.scaling(),
    )(EngineReplica)
    # the ingress only relays: it holds every stream the engines run plus those waiting for them
    streams = cfg.limits.max_concurrency * (cluster.max_replicas or cluster.replicas) + cfg.limits.max_queue
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(INGRESS_MIN_ONGOING, 2 * streams),
    )(Ingress)  # fmt: skip
    settings = IngressConfig(
        limits=cfg.limits, ui_lang=ui_lang, api_key=api_key, random_weights=cfg.model == DEMO_TINY,
        board=board, refresh_s=cluster.report_interval_s, stale_s=cluster.stale_s,
    )  # fmt: skip
    return ingress.bind(engines.bind(cfg, board, cluster.report_interval_s, cluster.stale_s), settings)


def build(args: dict[str, Any]) -> Any:
    """``serve deploy`` builder: ``args`` are ``app.py``'s flags without dashes (``max-concurrency: 16``)
    plus the cluster's (``replicas``, ``gpus-per-replica`` ...), checked by the same parser."""
    from server.cli import engine_config, parse_args

    argv = [f"--{key}={value}" for key, value in args.items()]
    ns = parse_args(argv)
    return application(
        engine_config(ns), cluster_config(ns, gpus=1.0), ui_lang=ns.ui_lang, api_key=ns.api_key
    )


def cluster_config(ns: argparse.Namespace, gpus: float) -> ClusterConfig:
    """The cluster's flags; ``gpus`` is the per-replica default when ``--gpus-per-replica`` is not given."""
    per_gpu = gpus if ns.gpus_per_replica is None else ns.gpus_per_replica
    return ClusterConfig(
        replicas=max(1, ns.replicas), min_replicas=ns.min_replicas, max_replicas=ns.max_replicas,
        gpus_per_replica=per_gpu, cpus_per_replica=ns.cpus_per_replica,
    )  # fmt: skip


def run_local(ns: argparse.Namespace) -> None:
    """A local Ray with Serve's ingress on ``--host:--port``, and the application; blocks until SIGINT or
    SIGTERM, then stops Serve (its HAProxy included) and Ray."""
    import ray

    from server.cli import engine_config

    # a new Ray on this machine (not one a `ray start` left running); its workers import this checkout
    slow_host_tolerance()
    fast_path()
    ray.init(address="local", namespace="cosystream", runtime_env=worker_env())
    stop = stop_on_signals()  # after ray.init, which installs a SIGTERM handler that aborts the process
    try:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        cluster = cluster_config(ns, gpus)
        serve.start(http_options={"host": ns.host, "port": ns.port})
        log.info("starting %d engine replicas (%s GPU each) behind http://%s:%d", cluster.replicas,
                 cluster.gpus_per_replica, ns.host, ns.port)  # fmt: skip
        app = application(engine_config(ns), cluster, ui_lang=ns.ui_lang, api_key=ns.api_key)
        serve.run(app, name=cluster.app_name, route_prefix="/")
        log.info("serving; Ctrl-C or SIGTERM stops the replicas")
        stop.wait()
    finally:
        log.info("stopping Serve and Ray")
        serve.shutdown()
        ray.shutdown()


def stop_on_signals() -> threading.Event:
    """An event that SIGINT or SIGTERM sets. Set explicitly: a shell starts a background job with SIGINT
    ignored (Python then never raises KeyboardInterrupt), and Ray's driver handler would exit without
    stopping Serve, leaving its HAProxy on the port."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


# Serve's documented high-throughput mode (Ray >= 2.55): HAProxy as the front instead of the Python HTTP
# proxy actor, direct ingress, gRPC between deployments, user code on the replica's own event loop. Through
# one replica on an H200 it cut the 1-stream TTFA gap to one process from 20 to 7 ms (BENCHMARKS "Over HTTP").
# Set any of them to 0 beforehand to opt out. Replica logs stay on the console (the mode turns them off).
# The ingress's drain on stop (30 s by default, for a load balancer to take it out) is 2 s: on one machine
# the whole app stops together.
FAST_PATH_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def fast_path() -> None:
    """Before ``ray.init``: the raylet, the controller and the replicas inherit this environment."""
    for key, value in FAST_PATH_ENV.items():
        os.environ.setdefault(key, value)


def worker_env() -> dict[str, Any]:
    """Ray's runtime env for the replicas: this checkout first on their path, then whatever this process
    had there (packages installed with ``pip --target``, as on an offline GPU host, stay importable)."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}


def slow_host_tolerance() -> None:
    """Serve gives its HTTP proxy 5 s to report ready, then kills it, and ``serve.start`` fails with it:
    a busy host (seen on a loaded 2-core CI box) misses that. The raylet, and so the controller, inherit
    this process's environment, so set a longer check before ``ray.init`` starts them."""
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
