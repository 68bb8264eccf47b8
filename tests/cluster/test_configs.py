"""The Serve config and the KubeRay example are valid Serve configs whose application builds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("ray.serve")

from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from cluster.application import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, REPO, build, worker_env

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
