"""HiFT vocoder: yaml config, strict hift.pt loading, parity with ref_hift.npz, full-size structure."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.vocoder.hift import TAIL_FRAMES, CausalHiFTGenerator, HiFTGenerator, V2Noise, build_hift
from engine.vocoder.hift_config import SOURCE_CACHE_SAMPLES, F0PredictorConfig, HiftConfig
from engine.vocoder.hift_layers import causal_padding
from engine.vocoder.hift_noise import HiftNoise
from tests.conftest import FAMILIES, case_params, fixture_file, tiny_yaml

ATOL = 1e-4
# f0 is in Hz (hundreds): float32 keeps ~7 significant digits and the summation order of the predictor's
# convs differs between CPUs' SIMD widths, e.g. 2.1e-4 at 278 Hz (7.7e-7 relative) on one Xeon. Relative
# to the peak, then; inaudible, and the audio computed from it is still held to ATOL.
F0_RTOL = 2e-6


def _config(case: Path) -> HiftConfig:
    return HiftConfig.from_yaml(tiny_yaml(case)["hift"])


def _loaded(case: Path) -> HiFTGenerator | CausalHiFTGenerator:
    hift = build_hift(_config(case))
    hift.load_state_dict(torch.load(fixture_file(case / "hift.pt"), weights_only=True), strict=True)
    if isinstance(hift, CausalHiFTGenerator):
        hift.set_noise(_fixture_noise(case))
    return hift.eval()


def _fixture_noise(case: Path) -> HiftNoise:
    z = np.load(fixture_file(case / "ref_hift_noise.npz"))
    return HiftNoise(*(torch.from_numpy(z[k]) for k in ("rand_ini", "sine_waves_prefix", "uv_prefix")))


def _close(actual: torch.Tensor, ref: np.ndarray, name: str) -> None:
    assert tuple(actual.shape) == ref.shape, f"{name}: shape {tuple(actual.shape)} != {ref.shape}"
    err = np.abs(actual.detach().double().numpy() - ref.astype(np.float64)).max()
    tol = max(ATOL, F0_RTOL * float(np.abs(ref).max())) if name.endswith("f0") else ATOL
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g}"


def _v2_run(
    hift: HiFTGenerator, z: np.lib.npyio.NpzFile, gen: torch.Generator | None
) -> dict[str, torch.Tensor]:
    speech, source = hift.inference(torch.from_numpy(z["mel"]), generator=gen)
    cache = torch.from_numpy(z["call2_cache_source"])
    speech2, source2 = hift.inference(torch.from_numpy(z["call2_mel"]), cache, generator=gen)
    return {"speech": speech, "source": source, "call2_speech": speech2, "call2_source": source2}


@case_params()
def test_config_from_tiny_yaml(case: Path) -> None:
    cfg, node = _config(case), tiny_yaml(case)["hift"]
    assert cfg.causal == node["__tag__"].endswith(".CausalHiFTGenerator")
    assert cfg.base_channels == node["base_channels"] and cfg.in_channels == node["in_channels"]
    assert cfg.f0_predictor.cond_channels == node["f0_predictor"]["cond_channels"]
    hop = node["istft_params"]["hop_len"]  # samples per STFT frame after the upsampling convs
    assert cfg.samples_per_frame == math.prod(node["upsample_rates"]) * hop
    assert SOURCE_CACHE_SAMPLES % cfg.samples_per_frame == 0
    if cfg.causal:  # the mel frames a non-final call holds back: f0 and conv_pre look ahead, one more frame
        assert cfg.conv_pre_look_right == node["conv_pre_look_right"]
        assert cfg.withheld_frames == cfg.f0_predictor.look_ahead + node["conv_pre_look_right"] + 1
    else:
        assert cfg.withheld_frames == 0


def test_config_defaults_and_validation() -> None:
    assert F0PredictorConfig(causal=True).look_ahead == causal_padding(4)  # the first conv: kernel 4, right
    cfg = HiftConfig()
    assert (cfg.base_channels, cfg.f0_predictor.cond_channels, cfg.upsample_rates) == (512, 512, (8, 5, 3))
    with pytest.raises(ValueError, match=r"f0_predictor\.causal"):
        HiftConfig(causal=True)
    with pytest.raises(ValueError, match="base_channels"):
        HiftConfig(base_channels=100)
    with pytest.raises(ValueError, match="unknown keys"):
        HiftConfig.from_yaml({"__tag__": "new:x.HiFTGenerator", "bogus": 1})
    with pytest.raises(ValueError, match="unsupported class"):
        HiftConfig.from_yaml({"__tag__": "new:x.HiFiGANGenerator"})


@case_params()
def test_tiny_parity(case: Path) -> None:
    z = np.load(fixture_file(case / "ref_hift.npz"))
    hift = _loaded(case)
    mel = torch.from_numpy(z["mel"])
    if isinstance(hift, HiFTGenerator):
        _close(hift.f0_predictor(mel), z["f0"], "f0")
        torch.manual_seed(int(z["rng_seed"]))
        for name, out in _v2_run(hift, z, None).items():
            _close(out, z[name], name)
    else:
        _close(hift.predict_f0(mel), z["f0"], "f0")
        _close(hift.predict_f0(mel, finalize=False), z["nonfinal_f0"], "nonfinal_f0")
        for prefix, finalize in (("", True), ("nonfinal_", False)):
            speech, source = hift.inference(mel, finalize=finalize)
            _close(speech, z[prefix + "speech"], prefix + "speech")
            _close(source, z[prefix + "source"], prefix + "source")
        assert hift.f0_predictor.classifier.weight.dtype == torch.float64


@case_params("cosyvoice2")
def test_v2_private_generator_matches_global_stream(case: Path) -> None:
    z = np.load(fixture_file(case / "ref_hift.npz"))
    hift = _loaded(case)
    assert isinstance(hift, HiFTGenerator)
    before = torch.get_rng_state()
    outs = _v2_run(hift, z, torch.Generator().manual_seed(int(z["rng_seed"])))
    assert torch.equal(before, torch.get_rng_state()), "a private generator must not touch the global RNG"
    for name, out in outs.items():
        _close(out, z[name], name)
    other, _ = hift.inference(torch.from_numpy(z["mel"]), generator=torch.Generator().manual_seed(7))
    assert not torch.allclose(other, outs["speech"]), "the noise must depend on the generator"


@case_params("cosyvoice2")
def test_v2_drawn_noise_is_the_references_draws(case: Path) -> None:
    """``draw_noise`` makes the reference's draws from the seed, and leaves the generator where the
    reference's call does (the second call's draws follow)."""
    z = np.load(fixture_file(case / "ref_hift.npz"))
    hift, gen = _loaded(case), torch.Generator().manual_seed(int(z["rng_seed"]))
    assert isinstance(hift, HiFTGenerator)
    for prefix, mel in (("", z["mel"]), ("call2_", z["call2_mel"])):
        noise = hift.draw_noise(torch.from_numpy(mel), gen)
        rand_ini = z[prefix + "draw1_rand_ini"].copy()
        rand_ini[:, 0] = 0  # the fundamental's phase
        assert torch.equal(noise.rand_ini, torch.from_numpy(rand_ini))
        assert torch.equal(noise.sines, torch.from_numpy(z[prefix + "draw2_sine_noise_randn"]))


# Rows vocoded together vs alone, float32 on CPU: batched convs (f0 predictor, decoder) block and sum in
# another order; measured 2026-12-01 (tiny v2, 2 cores, 6 seeds x 24/108/208 frames x 3-8 rows): max |diff|
# 1.2e-5, growing with the frames as the f0 rounding (9e-5 Hz at 318 Hz) integrates into the phase, so it is
# absolute, not relative to the speech (tiny models' streamed speech peaks near 0.015 and differs by as much).
# In float64 the same comparison agrees to 2e-14: rounding, not noise landing on other samples (that would
# differ by the noise itself, ~1e-3). Tolerance: float32 8x the measured difference (a full-suite run beside
# another one saw 4.2e-5 at one sample of 11520: the threads' summation order moves with the load).
V2_BATCH_ATOL = {torch.float64: 1e-12, torch.float32: 1e-4}


@case_params("cosyvoice2")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_v2_rows_vocoded_together_equal_each_row_alone(case: Path, dtype: torch.dtype) -> None:
    """Rows of one shape, each with noise drawn from its own generator and stacked, give in one call what
    each gives alone with its generator; every generator ends where the lone call leaves it."""
    hift, cfg = _loaded(case).to(dtype), _config(case)
    assert isinstance(hift, HiFTGenerator)
    g = torch.Generator().manual_seed(3)
    frames, cached = 24, SOURCE_CACHE_SAMPLES
    mels = [torch.randn(1, cfg.in_channels, frames, generator=g, dtype=dtype) for _ in range(4)]
    caches = [torch.rand(1, 1, cached, generator=g, dtype=dtype) * 2 - 1 for _ in mels]
    alone = [torch.Generator().manual_seed(seed) for seed in range(len(mels))]
    together = [torch.Generator().manual_seed(seed) for seed in range(len(mels))]
    want = [hift.inference(m, c, gen) for m, c, gen in zip(mels, caches, alone)]
    noise = V2Noise.stack([hift.draw_noise(m, gen) for m, gen in zip(mels, together)])
    speech, source = hift.vocode(torch.cat(mels), torch.cat(caches), noise)
    assert speech.shape == (len(mels), frames * cfg.samples_per_frame) and speech.dtype == dtype
    for i, (row_speech, row_source) in enumerate(want):
        torch.testing.assert_close(speech[i : i + 1], row_speech, atol=V2_BATCH_ATOL[dtype], rtol=0)
        torch.testing.assert_close(source[i : i + 1], row_source, atol=V2_BATCH_ATOL[dtype], rtol=0)
        assert torch.equal(together[i].get_state(), alone[i].get_state())
    assert not torch.allclose(want[0][0], want[1][0]), "each row's noise comes from its own generator"
    with pytest.raises(ValueError, match="does not fit"):
        hift.vocode(torch.cat(mels)[:, :, :-1], None, noise)


@case_params("cosyvoice3")
def test_v3_recipe_noise_and_streaming_prefix(case: Path) -> None:
    z = np.load(fixture_file(case / "ref_hift.npz"))
    mel, cfg = torch.from_numpy(z["mel"]), _config(case)
    hift = build_hift(dataclasses.replace(cfg, noise_max_samples=mel.shape[2] * cfg.samples_per_frame))
    hift.load_state_dict(torch.load(fixture_file(case / "hift.pt"), weights_only=True), strict=True)
    speech, _ = hift.inference(mel)  # noise from the Appendix A recipe, not the fixture
    _close(speech, z["speech"], "speech (recipe noise)")
    frames = mel.shape[2] - cfg.withheld_frames // 2  # a prefix that ends inside the withheld tail
    partial, _ = hift.inference(mel[:, :, :frames], finalize=False)
    assert partial.shape[1] == (frames - cfg.withheld_frames) * cfg.samples_per_frame
    assert torch.allclose(partial, speech[:, : partial.shape[1]], atol=ATOL), (
        "streamed prefix must not change"
    )


def _v3_recipe_hift(case: Path, frames: int) -> CausalHiFTGenerator:
    """The case's v3 HiFT with the recipe's noise for up to ``frames`` frames."""
    cfg = _config(case)
    hift = build_hift(dataclasses.replace(cfg, noise_max_samples=frames * cfg.samples_per_frame))
    hift.load_state_dict(torch.load(fixture_file(case / "hift.pt"), weights_only=True), strict=True)
    assert isinstance(hift, CausalHiFTGenerator)
    return hift.eval()


@case_params("cosyvoice3")
def test_v3_final_rows_vocoded_together_equal_each_row_alone(case: Path) -> None:
    """``finals``: the rows' last calls in one padded call plus one call over their last frames give each
    row, right edge included, what it gets alone; a plain padded call alone does not (its edge differs)."""
    hift = _v3_recipe_hift(case, 200)
    g = torch.Generator().manual_seed(3)
    mels = [torch.randn(1, 80, n, generator=g) for n in (TAIL_FRAMES, 57, 140, 141)]
    alone = [hift.inference(m, True)[0] for m in mels]
    for got, want in zip(hift.finals(mels), alone):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    padded = hift.inference(torch.cat([F.pad(m, (0, 141 - m.shape[2])) for m in mels]), True)[0]
    edge = [(padded[i, : w.shape[1]] - w[0]).abs() for i, w in enumerate(alone[:3])]
    assert all(e[: -hift.config.samples_per_frame].max() < 1e-5 for e in edge)  # exact but the last frame
    assert all(e.max() > 1e-5 for e in edge)  # ... where the padding shows
    with pytest.raises(ValueError, match=f"at least {TAIL_FRAMES} frames"):
        hift.finals([mels[0][:, :, :-1], mels[1]])


@case_params()
def test_legacy_weight_g_v_keys_and_folding(case: Path) -> None:
    state = torch.load(fixture_file(case / "hift.pt"), weights_only=True)
    legacy = {
        k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): v
        for k, v in state.items()
    }
    assert any(k.endswith("weight_g") for k in legacy)
    hift = build_hift(_config(case))
    hift.load_state_dict(legacy, strict=True)
    reference = _loaded(case)
    loaded = hift.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded[key], value), key
    mel = torch.from_numpy(np.load(fixture_file(case / "ref_hift.npz"))["mel"])
    before = _run_fixed(reference, mel)
    reference.fold_weight_norm()
    assert not any("parametrizations" in k for k in reference.state_dict())
    assert torch.allclose(_run_fixed(reference, mel), before, atol=1e-5)


def _run_fixed(hift: HiFTGenerator | CausalHiFTGenerator, mel: torch.Tensor) -> torch.Tensor:
    if isinstance(hift, HiFTGenerator):
        return hift.inference(mel, generator=torch.Generator().manual_seed(0))[0]
    return hift.inference(mel)[0]


@case_params()
def test_bad_inputs_fail_loudly(case: Path) -> None:
    hift, cfg = _loaded(case), _config(case)
    mels, per_frame = cfg.in_channels, cfg.samples_per_frame
    with pytest.raises(ValueError, match="mel must be"):
        hift.inference(torch.zeros(1, mels // 2, 10))
    if isinstance(hift, CausalHiFTGenerator):
        with pytest.raises(ValueError, match="mel must be"):
            hift.inference(torch.zeros(1, mels, cfg.withheld_frames - 1), finalize=False)
        noise_frames = _fixture_noise(case).num_samples // per_frame
        with pytest.raises(ValueError, match="noise buffer"):
            hift.inference(torch.zeros(1, mels, noise_frames + 1))
    else:
        with pytest.raises(ValueError, match="cache_source"):  # a cache longer than the chunk's audio
            hift.inference(torch.zeros(1, mels, 2), torch.zeros(1, 1, 2 * per_frame + 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_structure_matches_manifest(family: str) -> None:
    info = json.loads(fixture_file(family, "manifest_hift.json").read_text())
    causal = info["class"].endswith(".CausalHiFTGenerator")
    with torch.device("meta"):
        hift = build_hift(HiftConfig(causal=causal, f0_predictor=F0PredictorConfig(causal=causal)))
    got = [(k, list(v.shape)) for k, v in hift.state_dict().items()]
    assert got == [(e["key"], e["shape"]) for e in info["keys"]]
    assert sum(p.numel() for p in hift.parameters()) == info["num_parameters_unique"]


@pytest.mark.parametrize("frames", [2, 37])
def test_overlap_add_istft_equals_torch_istft(frames: int) -> None:
    """The explicit overlap-add (no host-side check, so it can be recorded in a CUDA graph) computes what
    torch.istft(center=True) does with the periodic Hann window."""
    hift = build_hift(HiftConfig(causal=True, f0_predictor=F0PredictorConfig(causal=True)))
    gen = torch.Generator().manual_seed(frames)
    magnitude = torch.rand(2, 9, frames, generator=gen) * 200  # above the 1e2 clip too
    phase = torch.randn(2, 9, frames, generator=gen) * 3
    clipped = magnitude.clamp(max=1e2)
    spec = torch.complex(clipped * torch.cos(phase), clipped * torch.sin(phase))
    want = torch.istft(spec, 16, 4, 16, window=hift.stft_window)
    got = hift._istft(magnitude, phase)
    assert got.shape == want.shape == (2, (frames - 1) * 4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
