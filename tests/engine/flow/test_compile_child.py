"""A flow program compiled by a child process (engine.flow.compile_child): the child builds the estimator at
its architecture with random weights, compiles the server's call and saves it under the server's file name;
the server loads it, reads its own weights through it and compiles nothing itself. A child that fails, a
call it cannot describe, or a module that is not the server's leave the compile to the server.

On the CPU Inductor builds C++ (g++): one test compiles the tiny DiT in a child (~40 s here); the others use
a toy module compiled here, or none."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.flow import compile_child
from engine.flow.compile_child import Arg, Job
from engine.flow.compiled_estimator import CompiledEstimator
from engine.flow.dit import DiT
from engine.flow.precompiled import Precompiled
from tests.engine.flow.test_dit_cache import tiny_flow
from tests.engine.flow.test_precompiled import TOLERANCE, Eager, Toy, dit_inputs, no_compiles, toy_matches

REPO = Path(__file__).resolve().parents[3]
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs g++")


@needs_gxx
def test_a_program_the_root_lacks_is_compiled_by_a_child_and_loaded_here(tmp_path, monkeypatch, caplog):
    est = tiny_flow("cosyvoice3").decoder.estimator
    fallback = Eager(est)
    run = Precompiled(DiT.forward, est, tmp_path, "forward", fallback, compile_child.compile_elsewhere)
    no_compiles(monkeypatch)  # this process may load, never trace
    with caplog.at_level(logging.INFO, "engine.flow"), torch.inference_mode():
        args = dit_inputs(2, 40, streaming=True)
        got = run(*args)
        want = est(*args)
        other = dit_inputs(3, 56, streaming=True, seed=1)  # other sizes: the same program
        torch.testing.assert_close(run(*other), est(*other), atol=TOLERANCE, rtol=TOLERANCE)
    # this process's weights, not the child's random ones: the output is this module's
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    assert fallback.calls == 0 and "the child compiled and saved" in caplog.text
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if n.endswith(".bin")] == [f"{run.stem(next(iter(run.programs)))}.0.bin"]
    assert any(n.endswith(".child.log") for n in names) and any(n.endswith(".child.json") for n in names)


def test_a_child_that_saves_nothing_leaves_the_compile_here(tmp_path, caplog):
    toy, asked = Toy().eval(), []

    def failing_child(module, name, root, args) -> bool:
        asked.append((module, name, root, len(args)))
        return False

    fallback = Eager(toy)
    run = Precompiled(Toy.forward, toy, tmp_path, "forward", fallback, failing_child)
    toy_matches(run, toy, (2, 30, False), (4, 20, False))
    assert asked == [(toy, "forward", tmp_path, 3)]  # once: the second call's program is the first's
    assert fallback.calls == 0 and [p.name[-6:] for p in tmp_path.iterdir()] == [".0.bin"]


def test_an_estimator_no_child_can_rebuild_is_compiled_here(tmp_path, caplog):
    """The Toy is no flow estimator a child can rebuild: no child starts, and the call still gets its
    program, compiled here."""
    toy = Toy().eval()
    fallback = Eager(toy)
    run = Precompiled(Toy.forward, toy, tmp_path, "forward", fallback, compile_child.compile_elsewhere)
    with caplog.at_level(logging.INFO, "engine.flow.compile_child"):
        toy_matches(run, toy, (2, 30, False))
    assert "compiled here (no child compile for a Toy estimator)" in caplog.text
    assert fallback.calls == 0 and [p.name[-6:] for p in tmp_path.iterdir()] == [".0.bin"]


def test_the_child_refuses_a_module_that_is_not_the_servers(tmp_path):
    est = tiny_flow("cosyvoice3").decoder.estimator
    with torch.inference_mode():
        job = Job.of(est, "forward", tmp_path, dit_inputs(2, 40))
    wrong = dataclasses.replace(job, identity="another model")
    path = tmp_path / "job.json"
    path.write_text(json.dumps(dataclasses.asdict(wrong)))
    done = subprocess.run(
        [sys.executable, "-m", "engine.flow.compile_child", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == compile_child.JOB_EXIT["identity"], done.stderr[-2000:]
    assert "not the server's" in done.stderr and not list(tmp_path.glob("*.bin"))


def test_a_job_describes_the_call_and_the_module_as_the_child_rebuilds_them(tmp_path):
    est = tiny_flow("cosyvoice3").decoder.estimator
    base = torch.arange(24.0).reshape(2, 3, 4)
    with torch.inference_mode():
        odd = torch.zeros(2, 80, 1).expand(2, 80, 7)  # stride 0 on the last dimension, an inference tensor
    args = (base.transpose(1, 2), odd, True, 3, None)
    job = Job.of(est, "forward", tmp_path, args)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(dataclasses.asdict(job)))
    assert Job.read(path) == job
    made = job.examples()
    for a, m in zip(args[:2], made[:2]):
        assert isinstance(m, torch.Tensor)
        assert (m.shape, m.stride(), m.dtype, m.is_inference()) == (
            a.shape,
            a.stride(),
            a.dtype,
            a.is_inference(),
        )
        assert not m.any()  # zeros: in range wherever a value indexes
    assert made[2:] == [True, 3, None]
    rebuilt = job.module()  # random weights, the same identity: the child's file is the server's
    assert compile_child.identity(rebuilt) == job.identity
    assert not torch.equal(next(rebuilt.parameters()), next(est.parameters()))


def test_a_call_it_cannot_describe_is_compiled_here(tmp_path):
    est = tiny_flow("cosyvoice3").decoder.estimator
    assert compile_child.compile_elsewhere(est, "forward", tmp_path, (torch.zeros(1), [1, 2])) is False
    assert not list(tmp_path.iterdir())  # no child started, nothing written
    with pytest.raises(TypeError, match="plain values"):
        Arg.of([1, 2])


def test_the_flag_reaches_the_programs_and_their_twin(tmp_path):
    est = tiny_flow("cosyvoice3").decoder.estimator
    child = CompiledEstimator(est, torch.float32, compiled=True, precompiled=tmp_path, compile_child=True)
    for run in (child.run, child.run_paged, child.twin(compiled=True).run):
        assert isinstance(run, Precompiled) and run.elsewhere is compile_child.compile_elsewhere
    plain = CompiledEstimator(est, torch.float32, compiled=True, precompiled=tmp_path)
    assert isinstance(plain.run, Precompiled) and plain.run.elsewhere is None


def test_the_engine_config_switch():
    from engine.config import EngineConfig
    from server import cli

    assert EngineConfig().flow_compile_child is False
    assert cli.engine_config(cli.parse_args(["--flow-compile-child"])).flow_compile_child is True
    with pytest.raises(ValueError, match="flow_compile_child"):
        EngineConfig(flow_compile_child="yes")  # type: ignore[arg-type]


def test_no_child_starts_where_the_device_has_no_room_for_its_call(tmp_path, monkeypatch, caplog):
    """On an accelerator the child must hold the call's tensors (the page pool's among them) and a copy of
    the module beside this process: where that passes 90 % of the free memory, the server compiles at
    once instead of waiting for the child's out-of-memory."""
    from engine import device as devices

    est = tiny_flow("cosyvoice3").decoder.estimator
    args = (torch.zeros(4, 2**20), True)  # 16 MiB of float32
    job = Job.of(est, "forward", tmp_path, args)
    weights = sum(p.numel() * p.element_size() for p in (*est.parameters(), *est.buffers()))
    assert sum(a.nbytes for a in job.args) == 16 * 2**20
    monkeypatch.setattr(devices, "is_accelerator", lambda dev: True)
    monkeypatch.setattr(devices, "free_memory_bytes", lambda dev: int((16 * 2**20 + weights) / 0.9) - 1)
    with caplog.at_level(logging.INFO, "engine.flow.compile_child"):
        assert compile_child.compile_elsewhere(est, "forward", tmp_path, args) is False
    assert "a child would need 0.0 GiB of device memory" in caplog.text and not list(tmp_path.iterdir())
    monkeypatch.setattr(devices, "free_memory_bytes", lambda dev: int((16 * 2**20 + weights) / 0.9) + 1)
    assert compile_child._no_room(job, est) is None
