"""The Serve config and the KubeRay example are valid Serve configs whose application builds."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("ray.serve")

from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from cluster.application import (
    ENGINE_DEPLOYMENT,
    FAST_PATH_ENV,
    INGRESS_DEPLOYMENT,
    REPO,
    build,
    fast_path,
    stop_on_signals,
    worker_env,
)

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def serve_configs() -> list[dict[str, Any]]:
    plain = yaml.safe_load((CLUSTER / "serve_config.yaml").read_text())
    service = next(
        d for d in yaml.safe_load_all((CLUSTER / "kuberay.yaml").read_text()) if d["kind"] == "RayService"
    )
    return [plain, yaml.safe_load(service["spec"]["serveConfigV2"])]


@pytest.mark.parametrize("config", serve_configs(), ids=["serve_config", "kuberay"])
def test_config_is_valid_and_its_application_builds(config: dict[str, Any]) -> None:
    schema = (
        ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else None
    )
    assert schema is not None and len(schema.applications) == 1
    app = schema.applications[0]
    assert app.import_path == "cluster.application:build"
    assert {d["name"] for d in config["applications"][0]["deployments"]} == {
        ENGINE_DEPLOYMENT,
        INGRESS_DEPLOYMENT,
    }
    engine = next(d for d in config["applications"][0]["deployments"] if d["name"] == ENGINE_DEPLOYMENT)
    bounds = engine["autoscaling_config"]
    assert 1 <= bounds["min_replicas"] <= bounds["initial_replicas"] <= bounds["max_replicas"]
    assert engine["ray_actor_options"]["num_gpus"] == 1  # one whole engine per GPU
    assert isinstance(build(app.args), Application)  # the args are app.py flags it accepts


def test_build_refuses_an_unknown_flag() -> None:
    with pytest.raises(SystemExit):
        build({"no-such-flag": 1})


def test_replicas_import_this_checkout_then_the_callers_path(monkeypatch) -> None:
    """Packages installed with ``pip --target`` (the offline GPU host) reach the replicas' workers."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/site", str(REPO), "/opt/more"]))
    assert worker_env()["env_vars"]["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/opt/site", "/opt/more"]
    monkeypatch.delenv("PYTHONPATH")
    assert worker_env() == {"env_vars": {"PYTHONPATH": str(REPO)}}


def test_kuberay_nodes_run_serve_in_the_same_mode_as_a_local_run() -> None:
    """The fast path is read by Ray's own processes: every container of the example sets it."""
    cluster = next(
        d for d in yaml.safe_load_all((CLUSTER / "kuberay.yaml").read_text()) if d["kind"] == "RayService"
    )["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    wanted = {k: v for k, v in FAST_PATH_ENV.items() if "DRAINING" not in k}  # a local stop only
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in container["env"]}
            assert wanted.items() <= env.items(), container["name"]


def test_fast_path_fills_in_what_the_operator_did_not_set(monkeypatch) -> None:
    for key in FAST_PATH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # an operator's opt-out stays
    fast_path()
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_ends_the_local_run_instead_of_killing_it(sig) -> None:
    """run_local waits on this event and then shuts Serve down (its HAProxy would outlive a kill)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = stop_on_signals()
        assert not stop.is_set()
        os.kill(os.getpid(), sig)
        assert stop.wait(5)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
