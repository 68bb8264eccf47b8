"""bench.aot_check on the tiny v3 model on the CPU: the estimator exports with dynamic batch and frames,
compiles into an AOTInductor package, and the package matches the eager estimator at shapes it was not
exported at; so does the page-window program, exported at a stream's first call and checked at two
streams' later one. AOTInductor on the CPU compiles C++: skipped where no compiler is on the PATH."""

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
    paged = result["paged"]
    assert (out / "paged.pt2").is_file() and paged["max_abs_diff"] < 1e-4 and paged["package_ms"] > 0
    # x [2B, 80, lead + queries] and the page table [2B, width]: checked at other rows, frames and width
    (x0, *_, table0, _, _, _, _), (x1, *_, table1, _, _, _, _) = paged["exported_at"], paged["checked_at"]
    assert x0[0] == 2 and x1[0] == 4 and x0[2] != x1[2] and table0[1] < table1[1]
