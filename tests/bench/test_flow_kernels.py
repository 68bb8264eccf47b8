"""bench.flow_kernels on the CPU at tiny size: every variant times each shape and reports its fidelity."""

from __future__ import annotations

import json

import pytest
import torch

from bench.flow_kernels import _reference, bucket_inputs, build_cfm, main, parse_args, sdpa_backends
from engine.flow.cfm import CfmInputs


def test_reports_timings_and_fidelity_per_variant(tmp_path):
    argv = ["--family", "v3", "--size", "tiny", "--device", "cpu", "--variants", "autocast,bf16"]
    argv += ["--shapes", "1x100,2x100", "--repeats", "1", "--cache-dir", str(tmp_path / "cc")]
    report = main([*argv, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "flow_kernels_v3.json").read_text())
    assert saved == json.loads(json.dumps(report))
    shapes = [(t["variant"], t["batch"], t["frames"]) for t in saved["timings"]]
    assert shapes == [("autocast", 1, 100), ("autocast", 2, 100), ("bf16", 1, 100), ("bf16", 2, 100)]
    assert all(t["ms_per_solve"] > 0 and t["frames_per_s"] > 0 for t in saved["timings"])
    # on the CPU both variants compute in float32: the same numbers as the reference solve
    assert [f["relative_rms"] for f in saved["fidelity"]] == [0.0] * 4


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--variants", "tensorrt", "--out", "x"])


def test_sdpa_restricts_the_attention_kernels_the_solve_may_use(tmp_path):
    """``--sdpa math`` solves as before (and says so in the report); ``--sdpa efficient`` has no kernel on
    the CPU, so the solve fails: the restriction reaches the estimator's attention."""
    argv = ["--family", "v3", "--size", "tiny", "--device", "cpu", "--variants", "bf16", "--no-fidelity"]
    argv += ["--shapes", "1x100", "--repeats", "1", "--cache-dir", str(tmp_path / "cc")]
    argv += ["--out", str(tmp_path)]
    report = main([*argv, "--sdpa", "math"])
    assert report["sdpa"] == "math" and len(report["timings"]) == 1  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="No viable backend"):
        main([*argv, "--sdpa", "efficient"])
    with pytest.raises(SystemExit):
        parse_args(["--sdpa", "tensorrt", "--out", "x"])


def test_attention_folded_runs_the_solver_with_the_rule_in_qk_dims(tmp_path):
    argv = ["--family", "v2", "--size", "tiny", "--device", "cpu", "--variants", "bf16", "--shapes", "2x100"]
    argv += ["--repeats", "1", "--cache-dir", str(tmp_path / "cc"), "--out", str(tmp_path)]
    report = main([*argv, "--attention", "folded"])
    assert report["attention"] == "folded" and len(report["timings"]) == 1  # type: ignore[arg-type]
    assert [f["relative_rms"] for f in report["fidelity"]] == [0.0, 0.0]  # type: ignore[union-attr]


def test_attention_cudnn_is_the_engines_kernel_order_and_cuda_only(tmp_path):
    """``--attention cudnn`` enters the engine's order (``engine.device.cudnn_attention``), which refuses
    a CPU run with a clear error instead of timing the default kernels under its name."""
    argv = ["--family", "v3", "--size", "tiny", "--device", "cpu", "--variants", "bf16", "--shapes", "1x100"]
    argv += ["--cache-dir", str(tmp_path / "cc"), "--out", str(tmp_path), "--attention", "cudnn"]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        main(argv)


def test_the_float32_reference_runs_whatever_kernels_sdpa_allows_the_variant():
    """Under ``--sdpa cudnn`` the H200 had no float32 kernel for the reference solve; here ``efficient``
    (no CPU kernel) stands in: the reference still solves, and the restriction holds again after it."""
    cfm = build_cfm("v3", "tiny", torch.device("cpu"))
    mu, mask, spks, cond = bucket_inputs(1, 100, torch.device("cpu"))
    zero = torch.zeros(1, dtype=torch.long)
    with sdpa_backends("efficient"), torch.inference_mode():
        mel = _reference(cfm, (mu, mask, spks, cond), streaming=True)
        assert mel.shape == (1, 80, 100) and torch.isfinite(mel).all()
        with pytest.raises(RuntimeError, match="No viable backend"):
            cfm(CfmInputs(mu, mask, spks, cond, zero, zero), True)
