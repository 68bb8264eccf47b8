"""bench.precompile_check on the tiny v3 estimator on the CPU: the driver launches each arm as a fresh
process on one cache folder and keeps what it measured (its calls checked against eager); a process that
fails ends the run with its error, not a traceback of the driver. The four-process order itself runs on
the H200 (``run.sh precompile-check``): on 2 CPU cores its cold compile alone is ~35 s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import bench.precompile_check as check


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs a C++ compiler (g++)")
def test_an_arm_runs_in_a_fresh_process_and_matches_eager(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(check, "ORDER", ("compile",))
    out = tmp_path / "pc"
    result = check.main_result(["--size", "tiny", "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    assert json.loads((out / "precompile_check.json").read_text()) == result
    (run,) = result["runs"]
    assert run["arm"] == "compile" and run["wall_s"] > 0 and run["program_files"] == []
    assert [(c["batch"], c["frames"]) for c in run["calls"]] == list(check.SHAPES)
    assert all(c["seconds"] > 0 and c["max_abs_diff"] < 1e-4 for c in run["calls"])
    assert (out / "cache" / "inductor").is_dir()  # the cache the next process would find warm


def test_a_failing_process_ends_the_run_with_its_error(tmp_path: Path) -> None:
    result = check.main_result(["--device", "no-such-device", "--out", str(tmp_path / "pc")])
    (run,) = result["runs"]
    assert run["arm"] == "precompiled" and "calls" not in run and run["error"]
    assert "device" in run["error"][0].lower()
