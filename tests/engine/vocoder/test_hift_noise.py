"""v3 HiFT noise buffers: the Appendix A recipe on a private generator equals the reference buffers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.vocoder.f0_predictor import F0Predictor
from engine.vocoder.hift_config import FULL_NOISE_SAMPLES, F0PredictorConfig
from engine.vocoder.hift_noise import build_noise, shared_noise
from tests.conftest import case_params, fixture_file, tiny_yaml

TINY_F0 = F0PredictorConfig(causal=True, cond_channels=32)  # a small causal predictor


@case_params("cosyvoice3")
def test_tiny_recipe_equals_fixture_buffers(case: Path) -> None:
    z = np.load(fixture_file(case / "ref_hift_noise.npz"))
    f0 = F0PredictorConfig.from_yaml(tiny_yaml(case)["hift"]["f0_predictor"])  # its inits draw first
    before = torch.get_rng_state()
    noise = build_noise(f0, max_samples=z["sine_waves_prefix"].shape[1])
    assert torch.equal(before, torch.get_rng_state()), "building the noise must not touch the global RNG"
    assert np.array_equal(noise.rand_ini.numpy(), z["rand_ini"])
    assert np.array_equal(noise.sine_waves.numpy(), z["sine_waves_prefix"])
    assert np.array_equal(noise.uv.numpy(), z["uv_prefix"])


def test_private_stream_matches_real_constructors() -> None:
    """The init draws the recipe replays equal building the modules on the (forked) global generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.randn(1, 80, 15000)
        nn.Embedding(6561, 80)
        nn.Linear(192, 80)
        F0Predictor(TINY_F0)  # our module: weight norm must not consume random numbers
        rand_ini = torch.rand(1, 9)
        first_sines = torch.rand(1, 4, 9)
    noise = build_noise(TINY_F0, max_samples=4)
    assert torch.equal(noise.rand_ini[:, 1:], rand_ini[:, 1:]) and noise.rand_ini[0, 0] == 0
    assert torch.equal(noise.sine_waves, first_sines)


def test_full_size_recipe_matches_fingerprints() -> None:
    # v3 only (fixtures README): v2's HiFT keeps no noise buffers, it draws noise on every call
    info = json.loads(fixture_file("cosyvoice3", "full_size_inference_noise.json").read_text())
    noise = build_noise(F0PredictorConfig(causal=True))
    assert noise.rand_ini.tolist() == info["hift.m_source.l_sin_gen.rand_ini"]["values"]
    for key, tensor in (
        ("hift.m_source.l_sin_gen.sine_waves", noise.sine_waves),
        ("hift.m_source.uv", noise.uv),
    ):
        ref, flat = info[key], tensor.reshape(-1)
        assert list(tensor.shape) == ref["shape"]
        assert flat[:8].tolist() == ref["first"] and flat[-8:].tolist() == ref["last"]
        assert tensor.double().sum().item() == pytest.approx(ref["sum_f64"], rel=1e-12)
        assert hashlib.sha256(tensor.numpy().tobytes()).hexdigest() == ref["sha256_f32_bytes"]


def test_shared_noise_is_built_once_and_validated() -> None:
    a = shared_noise(TINY_F0, max_samples=1000)
    assert shared_noise(TINY_F0, max_samples=1000) is a
    assert a.sine_waves.shape == (1, 1000, 9) and a.uv.shape == (1, 1000, 1)
    with pytest.raises(ValueError, match="max_samples"):
        build_noise(TINY_F0, max_samples=FULL_NOISE_SAMPLES + 1)
