"""bench.weights_load on the tiny model: fresh processes, the converting one not counted, the figures
written; bad arguments refused."""

from __future__ import annotations

import json

import pytest

from bench import weights_load


def test_it_times_the_load_in_fresh_processes_after_one_that_converts(tmp_path):
    weights_load.main(["--family", "v3", "--size", "tiny", "--runs", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "weights_load.json").read_text(encoding="utf-8"))
    assert (result["family"], result["size"], result["device"]) == ("cosyvoice3", "tiny", "cpu")
    assert len(result["runs"]) == 2
    assert all(0 < r["load_s"] <= r["load_and_read_s"] for r in result["runs"])
    assert list((tmp_path / "cache" / "weights").rglob("*.safetensors"))  # the first process converted


def test_an_ab_measures_both_arms_each_round_the_first_alternating(tmp_path):
    """On the CPU both arms map the files (reading onto a device is an accelerator's); the bench's own
    order and labels are what is tested here."""
    weights_load.main(["--size", "tiny", "--runs", "2", "--arms", "onto,mapped", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "weights_load.json").read_text(encoding="utf-8"))
    assert [r["arm"] for r in result["runs"]] == ["onto", "mapped", "mapped", "onto"]
    assert all(r["load_s"] > 0 for r in result["runs"])


BAD = [["--runs", "0"], ["--arms", "onto,onto"], ["--arms", "mmap"], ["--arms", ""]]


@pytest.mark.parametrize("argv", BAD)
def test_bad_runs_and_arms_are_refused(tmp_path, argv):
    with pytest.raises(SystemExit):
        weights_load.main([*argv, "--out", str(tmp_path)])


def test_a_given_model_is_reported_as_its_own_family(tmp_path):
    from engine.demo.make_model import build_model_dir

    model = build_model_dir(tmp_path / "v2", "cosyvoice2", "tiny")
    weights_load.main(["--model", str(model), "--runs", "1", "--out", str(tmp_path / "out")])  # --family: v3
    result = json.loads((tmp_path / "out" / "weights_load.json").read_text(encoding="utf-8"))
    assert (result["family"], result["size"]) == ("cosyvoice2", None) and len(result["runs"]) == 1
