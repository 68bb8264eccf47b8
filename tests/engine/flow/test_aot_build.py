"""The child's build of the flow's ahead-of-time programs (engine.flow.aot_build), in process: programs
built from random weights run whichever weights they are bound to."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from engine.flow.aot_build import build
from engine.flow.aot_package import AotPrograms, AotSpec
from tests.engine.flow.test_dit_cache import tiny_flow

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="AOTInductor on the CPU needs g++")
CPU = torch.device("cpu")


def test_programs_hold_no_weights_and_run_whichever_they_are_bound_to(tmp_path, caplog):
    """v2's final and streaming programs built from random weights, bound to another estimator's: its
    eager output at sizes other than the recorded ones. Each step is logged as it ends (a native crash
    in the next is placed by the log)."""
    cfm = tiny_flow("cosyvoice2").decoder
    spec = AotSpec.of(cfm, torch.float32, CPU, cudnn=False, paged=False)
    with caplog.at_level(logging.INFO, "engine.flow.aot_package"):
        manifest = build(spec, tmp_path / "set")
    ours = [r.getMessage() for r in caplog.records if r.name == "engine.flow.aot_package"]
    steps = [m.split(" in ")[0].split(";")[0] for m in ours]
    want = [f"{n}.pt2: {s}" for n in ("final", "streaming") for s in ("exported", "compiled", "loaded")]
    assert steps == want
    assert manifest["streaming"]["max_abs_diff"] <= 1e-3 * manifest["streaming"]["output_scale"]
    programs = AotPrograms.load(tmp_path / "set", cfm.estimator)
    assert programs.paged is None and programs.windows(None) is None
    run = programs.whole(cfm.estimator)
    g = torch.Generator().manual_seed(3)
    x, mu, cond = (torch.randn(6, 80, 170, generator=g) for _ in range(3))
    mask, t, spks = (
        torch.ones(6, 1, 170),
        torch.rand(1, generator=g).expand(6),
        torch.randn(6, 80, generator=g),
    )
    with torch.inference_mode():
        for streaming in (False, True):
            want = cfm.estimator(x, mask, mu, t, spks, cond, streaming)
            torch.testing.assert_close(run(x, mask, mu, t, spks, cond, streaming), want, atol=1e-4, rtol=1e-4)
