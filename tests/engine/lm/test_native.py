"""The native backend's worker thread: healthy while it runs, not once closed."""

from __future__ import annotations

import torch

from bench.make_model import build_model_dir
from engine.checkpoint import load_model
from engine.config import SamplingConfig
from engine.hub import validate_model_dir
from engine.lm.native import NativeLM


def test_healthy_while_its_worker_runs(tmp_path):
    model = load_model(
        validate_model_dir(build_model_dir(tmp_path, "cosyvoice3", "tiny")), torch.device("cpu")
    )
    lm = NativeLM(model.lm, SamplingConfig())
    assert lm.healthy and lm.active == 0
    lm.close()
    assert not lm.healthy
