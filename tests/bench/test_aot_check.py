"""bench.aot_check on the tiny v3 model on the CPU: the estimator exports with dynamic batch and frames,
compiles into an AOTInductor package, and the package matches the eager estimator at shapes it was not
exported at. AOTInductor on the CPU compiles C++: skipped where no compiler is on the PATH."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.aot_check import SHAPES, main


@pytest.mark.skipif(shutil.which("g++") is None, reason="AOTInductor on the CPU needs a C++ compiler (g++)")
def test_the_tiny_estimator_runs_from_an_aot_package_as_it_runs_eager(tmp_path: Path) -> None:
    out = tmp_path / "aot"
    argv = ["--family", "v3", "--size", "tiny", "--device", "cpu"]
    result = main([*argv, "--out", str(out)])
    assert json.loads((out / "aot_check.json").read_text()) == result
    assert result["family"] == "cosyvoice3" and (out / "estimator.pt2").is_file()
    assert result["export_s"] > 0 and result["aoti_compile_s"] > 0 and result["load_s"] >= 0
    assert [(s["batch"], s["frames"]) for s in result["shapes"]] == list(SHAPES)
    assert all(s["max_abs_diff"] < 1e-4 and s["package_ms"] > 0 for s in result["shapes"])
