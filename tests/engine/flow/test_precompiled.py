"""Whole compiled programs kept on disk (engine.flow.precompiled): the first call compiles and saves one
that matches eager at other sizes; a fresh object, and a fresh process, load it without tracing and read
their own module's weights; a corrupt file, a failed compile or refused guards fall back (logged), still
right; each specialisation (batch 1, streaming) gets a file of its own; the flag reaches the estimator.

On the CPU Inductor builds C++ (g++): the tiny DiT compiles once for the module (~35 s here), the
specialisation cases use a toy module (seconds each); the fallback is eager and counted, so no test
compiles it (the engine's is today's ``torch.compile`` program)."""

from __future__ import annotations

import copy
import json
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from engine.demo.make_model import randomize
from engine.flow.compiled_estimator import CompiledEstimator
from engine.flow.dit import DiT
from engine.flow.precompiled import Precompiled, serving_thread, specialisation
from tests.engine.flow.test_dit_cache import tiny_flow

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs g++")
REPO = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-4  # float32: Inductor's fused kernels round differently from eager


class Eager:
    """The fallback, eager and counted (the engine's is ``torch.compile``'s program)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.calls = module, 0

    def __call__(self, *args: object) -> Tensor:
        self.calls += 1
        return self.module(*args)


def dit_inputs(batch: int, frames: int, streaming: bool = False, seed: int = 0) -> tuple:
    """The DiT's call: x, mask, mu [B,80,T] / [B,1,T], t [B], spks [B,80], cond [B,80,T], streaming."""
    gen = torch.Generator().manual_seed(seed)
    x, mu, cond = (torch.randn(batch, 80, frames, generator=gen) for _ in range(3))
    t, spks = torch.rand(batch, generator=gen), torch.randn(batch, 80, generator=gen)
    return x, torch.ones(batch, 1, frames), mu, t, spks, cond, streaming


def precompiled_dit(est: nn.Module, root: Path) -> tuple[Precompiled, Eager]:
    fallback = Eager(est)
    return Precompiled(DiT.forward, est, root, "forward", fallback), fallback


def no_compiles(monkeypatch) -> None:
    """Any compile from here on fails the test: a loaded program must not trace."""

    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the program was on disk")

    monkeypatch.setattr(torch, "compile", refuse)


@pytest.fixture(scope="module")
def dit(tmp_path_factory) -> tuple[nn.Module, Path]:
    """The tiny v3 DiT and a folder where its program for batch 2, not streaming, was compiled and saved."""
    est, root = tiny_flow("cosyvoice3").decoder.estimator, tmp_path_factory.mktemp("precompiled")
    run, fallback = precompiled_dit(est, root)
    with torch.inference_mode():
        run(*dit_inputs(2, 40))
    assert fallback.calls == 0
    return est, root


def assert_eager(run, est: nn.Module, *shapes: tuple[int, int]) -> None:
    with torch.inference_mode():
        for seed, (batch, frames) in enumerate(shapes):
            args = dit_inputs(batch, frames, seed=seed)
            torch.testing.assert_close(run(*args), est(*args), atol=TOLERANCE, rtol=TOLERANCE)


def test_the_first_call_saves_one_program_that_matches_eager_at_other_sizes(dit):
    est, root = dit
    assert [p.name[-6:] for p in root.iterdir()] == [".0.bin"]  # no temporary file left
    run, fallback = precompiled_dit(est, root)
    assert_eager(run, est, (3, 70), (2, 123), (8, 41))
    # one program for every batch of 2-15 and length (the tiny DiT's guards: a batch of 16 gets another)
    assert fallback.calls == 0 and [len(p or ()) for p in run.programs.values()] == [1]


def test_a_fresh_object_loads_the_program_and_runs_its_own_weights(dit, monkeypatch):
    est, root = dit
    other = copy.deepcopy(est)
    randomize(other, seed=7)  # the serving weights differ from those it was compiled with
    no_compiles(monkeypatch)
    run, fallback = precompiled_dit(other, root)
    assert_eager(run, other, (4, 55))
    assert fallback.calls == 0


def test_a_corrupt_file_falls_back_logged_and_right(dit, tmp_path, monkeypatch, caplog):
    est, root = dit
    (saved,) = root.iterdir()
    (tmp_path / saved.name).write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    no_compiles(monkeypatch)  # the compile again fails too (here: refused): the fallback serves
    run, fallback = precompiled_dit(est, tmp_path)
    with caplog.at_level(logging.INFO, "engine.flow.precompiled"):
        assert_eager(run, est, (3, 70))
    assert fallback.calls == 1 and list(run.programs.values()) == [None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "did not load" in warnings[0]
    assert "did not compile whole" in caplog.text
    # the corrupt file removed; the failed compile noted, for a key with no program left
    assert [p.suffix for p in tmp_path.iterdir()] == [".refused"]


def test_a_fresh_process_loads_the_program(dit):
    """The real warm start: another interpreter loads the file (no compile: torch.compile refused there)
    and matches its eager DiT."""
    _, root = dit
    code = f"""
import json, torch
from pathlib import Path
from engine.flow.dit import DiT
from engine.flow.precompiled import Precompiled
from tests.engine.flow.test_dit_cache import tiny_flow
from tests.engine.flow.test_precompiled import dit_inputs
torch.compile = None  # a trace would fail
est = tiny_flow("cosyvoice3").decoder.estimator
run = Precompiled(DiT.forward, est, Path({str(root)!r}), "forward", fallback=None)
with torch.inference_mode():
    args = dit_inputs(5, 66, seed=3)
    error = (run(*args) - est(*args)).abs().max().item()
print(json.dumps({{"error": error, "programs": len(run.programs)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["programs"] == 1 and result["error"] < TOLERANCE


class Toy(nn.Module):
    """A small estimator-like module: x [B,C,T], t [B], a streaming flag, and a plain setting (``scale``)
    that a compiled program bakes in."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.scale = nn.Conv1d(8, 8, 1), 2.0

    def forward(self, x: Tensor, t: Tensor, streaming: bool) -> Tensor:
        h = torch.nn.functional.gelu(self.proj(x)) * t[:, None, None] * self.scale
        return h.cumsum(-1) if streaming else h


def toy_call(batch: int, frames: int, streaming: bool) -> tuple:
    gen = torch.Generator().manual_seed(batch * 1000 + frames)
    return torch.randn(batch, 8, frames, generator=gen), torch.rand(batch, generator=gen), streaming


def test_the_specialisation_key_splits_sizes_0_and_1_and_the_flags_only():
    key = specialisation(toy_call(2, 50, False))
    assert specialisation(toy_call(16, 123, False)) == key
    assert len({key, specialisation(toy_call(1, 50, False)), specialisation(toy_call(2, 50, True))}) == 3
    assert specialisation(toy_call(1, 50, False)) != specialisation(toy_call(1, 1, False))
    assert specialisation((torch.zeros(2, 3).t(),)) != specialisation((torch.zeros(3, 2),))  # layout
    with torch.no_grad():
        assert specialisation(toy_call(2, 50, False)) != key  # the grad mode


def toy_matches(run: Precompiled, toy: Toy, *calls: tuple[int, int, bool]) -> None:
    with torch.inference_mode():
        for batch, frames, streaming in calls:
            args = toy_call(batch, frames, streaming)
            torch.testing.assert_close(run(*args), toy(*args), atol=TOLERANCE, rtol=TOLERANCE)


def test_each_specialisation_and_each_refusing_guard_gets_a_program_of_its_own(tmp_path, monkeypatch, caplog):
    """Batch 1 and streaming get files of their own, batch 5 shares batch 2's; a call that the guards
    refuse (a setting baked in changed) gets a second program for its key, which a fresh object loads; a
    call none accepts, with the compile failing, falls back (logged)."""
    toy = Toy().eval()
    fallback = Eager(toy)
    run = Precompiled(Toy.forward, toy, tmp_path, "forward", fallback)
    toy_matches(run, toy, (2, 30, False), (1, 30, False), (2, 30, True), (5, 70, False))
    assert sorted(p.name[-6:] for p in tmp_path.iterdir()) == [".0.bin"] * 3 and fallback.calls == 0
    toy.scale = 3.0  # the programs' guards refuse it
    toy_matches(run, toy, (2, 30, False))
    assert sorted(p.name[-6:] for p in tmp_path.iterdir()) == [".0.bin"] * 3 + [".1.bin"]
    no_compiles(monkeypatch)
    again = Precompiled(Toy.forward, toy, tmp_path, "forward", fallback)
    toy_matches(again, toy, (4, 50, False))  # the second program, loaded
    toy.scale = 5.0
    with caplog.at_level(logging.WARNING, "engine.flow.precompiled"):
        toy_matches(again, toy, (4, 50, False))
    assert fallback.calls == 1 and "did not compile whole" in caplog.text


def test_a_serving_thread_runs_eager_while_the_program_compiles_behind_it(tmp_path, monkeypatch, caplog):
    """On a serving thread (the token2wav worker) a call no program fits does not wait for a compile
    (minutes at full size): it runs eager, right, while one thread of its own compiles the key's program
    in the caller's modes, once for the calls meanwhile; the calls after it run the program."""
    toy = Toy().eval()
    fallback = Eager(toy)
    run = Precompiled(Toy.forward, toy, tmp_path, "forward", fallback)
    gate, compiles = threading.Event(), []
    compiled = Precompiled._compiled

    def held(self, *args):
        compiles.append(torch.is_inference_mode_enabled())
        assert gate.wait(60)
        return compiled(self, *args)

    monkeypatch.setattr(Precompiled, "_compiled", held)
    with serving_thread(), caplog.at_level(logging.WARNING, "engine.flow.precompiled"):
        toy_matches(run, toy, (2, 30, False), (3, 41, False))  # both before the compile may go on
    assert "no key has a program yet" in caplog.text
    (behind,) = [t for t in threading.enumerate() if t.name == "precompile"]
    assert not run.programs.get(specialisation(toy_call(2, 30, False)))
    gate.set()
    behind.join(120)
    assert compiles == [True] and fallback.calls == 0
    monkeypatch.setattr(Precompiled, "_compiled", lambda *args: pytest.fail("compiled again"))
    with serving_thread():
        toy_matches(run, toy, (5, 70, False))  # the program, whose guards take the serving mode's calls
    assert [len(p or ()) for p in run.programs.values()] == [1]
    assert not [t for t in threading.enumerate() if t.name == "precompile"]
    caplog.clear()
    monkeypatch.setattr(Precompiled, "_program", lambda *args: None)  # nothing made: the log is the point
    with serving_thread(), caplog.at_level(logging.WARNING, "engine.flow.precompiled"):
        toy_matches(run, toy, (1, 30, False))  # batch 1: a key of its own (x and t of size 1: parts 2, 3)
    assert "parts [2, 3] differ from the nearest of 1 keys with programs" in caplog.text


class Breaking(Toy):
    """The toy with a data-dependent branch on a value read back (``.item()``): a graph break, so it never
    compiles whole."""

    def forward(self, x: Tensor, t: Tensor, streaming: bool) -> Tensor:
        if x.abs().max().item() > 1e9:
            return x
        return super().forward(x, t, streaming)


def test_a_key_that_falls_back_is_compiled_behind_a_serving_thread_too(tmp_path):
    """A graph break: the program a serving call needs never compiles whole, and its fallback (in the
    engine ``torch.compile``, which compiles at its first call) runs once on the thread behind, while the
    serving calls meanwhile run eager; after that they run the fallback."""
    toy = Breaking().eval()
    fallback = Eager(toy)
    run = Precompiled(Breaking.forward, toy, tmp_path, "forward", fallback)
    with serving_thread():
        toy_matches(run, toy, (2, 30, False))
    for behind in [t for t in threading.enumerate() if t.name == "precompile"]:
        behind.join(120)
    assert fallback.calls == 1 and list(run.programs.values()) == [None]  # the thread behind, once
    with serving_thread():
        toy_matches(run, toy, (3, 40, False))
    assert fallback.calls == 2


def test_a_program_that_cannot_be_made_behind_leaves_its_serving_calls_eager(tmp_path, monkeypatch, caplog):
    """Whatever the thread behind meets (here the compile child's call failing) is logged once and the key's
    serving calls run eager from then on, right, with no second attempt."""
    toy = Toy().eval()
    fallback = Eager(toy)
    attempts: list[object] = []

    def elsewhere(*args: object) -> bool:
        attempts.append(args)
        raise OSError("no room for a child")

    run = Precompiled(Toy.forward, toy, tmp_path, "forward", fallback, elsewhere)
    monkeypatch.setattr(Precompiled, "_loaded", lambda self, stem: [])
    with serving_thread(), caplog.at_level(logging.WARNING, "engine.flow.precompiled"):
        toy_matches(run, toy, (2, 30, False))
        for behind in [t for t in threading.enumerate() if t.name == "precompile"]:
            behind.join(60)
        toy_matches(run, toy, (3, 40, False), (4, 50, False))
    assert len(attempts) == 1 and fallback.calls == 0
    assert "no program could be made" in caplog.text and "no room for a child" in caplog.text


def counted_compiles(monkeypatch, error: type[BaseException] = AssertionError) -> list[object]:
    """Every ``torch.compile`` from here on recorded, then failed with ``error``."""
    calls: list[object] = []

    def compile(fn, *args, **kwargs):
        calls.append(fn)
        raise error("compile attempted")

    monkeypatch.setattr(torch, "compile", compile)
    return calls


def test_a_key_that_does_not_compile_whole_is_not_traced_by_the_next_start(tmp_path, monkeypatch, caplog):
    """A graph break: the first start's compile fails and falls back, and its key is noted; the next start
    runs that key's fallback from the first call without a compile (each trace costs tens of seconds of a
    warm start on the H200), logged; another key is still compiled."""
    toy = Breaking().eval()
    fallback = Eager(toy)
    toy_matches(Precompiled(Breaking.forward, toy, tmp_path, "forward", fallback), toy, (2, 30, False))
    (note,) = tmp_path.iterdir()
    assert note.suffix == ".refused" and note.read_text().strip() and fallback.calls == 1
    compiles = counted_compiles(monkeypatch)
    again = Precompiled(Breaking.forward, toy, tmp_path, "forward", fallback)
    with caplog.at_level(logging.INFO, "engine.flow.precompiled"):
        toy_matches(again, toy, (3, 40, False), (5, 20, False))
    assert compiles == [] and fallback.calls == 3 and "did not compile whole before" in caplog.text
    toy_matches(again, toy, (1, 30, False))  # batch 1: a key of its own, not noted: compiled (here: fails)
    assert len(compiles) == 1 and fallback.calls == 4


def test_running_out_of_memory_in_a_compile_is_not_noted(tmp_path, monkeypatch):
    """Another start may have the memory: only a key that cannot compile whole is noted."""
    counted_compiles(monkeypatch, torch.OutOfMemoryError)
    toy = Toy().eval()
    fallback = Eager(toy)
    toy_matches(Precompiled(Toy.forward, toy, tmp_path, "forward", fallback), toy, (2, 30, False))
    assert fallback.calls == 1 and list(tmp_path.iterdir()) == []


def test_it_compiles_where_torch_leaves_aot_compile_off_by_default(tmp_path, monkeypatch):
    """torch 2.11 (the H200's image) gives ``torch.compile``'s function an ``aot_compile`` only with
    ``enable_aot_compile`` set, which 2.13 sets by default: with it off, the program still compiles and
    saves, and nothing falls back (every program of a start did on the H200 before)."""
    monkeypatch.setattr(torch._dynamo.config, "enable_aot_compile", False)
    toy = Toy().eval()
    fallback = Eager(toy)
    toy_matches(Precompiled(Toy.forward, toy, tmp_path, "forward", fallback), toy, (2, 30, False))
    assert fallback.calls == 0 and [p.name[-6:] for p in tmp_path.iterdir()] == [".0.bin"]


def test_the_flag_reaches_the_compiled_estimator(tmp_path):
    est = tiny_flow("cosyvoice3").decoder.estimator
    compiled = CompiledEstimator(est, torch.float32, compiled=True, precompiled=tmp_path)
    for run, name in ((compiled.run, "forward"), (compiled.run_paged, "forward_paged")):
        assert isinstance(run, Precompiled) and (run.root, run.name, run.module) == (tmp_path, name, est)
    twin = compiled.twin(compiled=True)
    assert isinstance(twin.run, Precompiled) and twin.run.root == tmp_path
    assert not isinstance(CompiledEstimator(est, torch.float32, compiled=True).run, Precompiled)


def test_a_program_that_cannot_be_saved_still_serves(tmp_path, caplog):
    """The folder cannot be made (a file holds its name): the compiled program serves this process,
    logged, and leaves no temporary file."""
    blocked = tmp_path / "precompiled"
    blocked.write_text("not a folder")
    toy = Toy().eval()
    fallback = Eager(toy)
    run = Precompiled(Toy.forward, toy, blocked / "programs", "forward", fallback)
    with caplog.at_level(logging.WARNING, "engine.flow.precompiled"):
        toy_matches(run, toy, (3, 20, False), (2, 44, False))
    assert fallback.calls == 0 and "could not save" in caplog.text and list(tmp_path.iterdir()) == [blocked]


@pytest.mark.parametrize(("attention", "folder"), [("mask", "compile"), ("cudnn", "compile/attention-cudnn")])
def test_the_engine_keeps_the_programs_beside_its_compile_cache(tmp_path, monkeypatch, attention, folder):
    from engine.config import EngineConfig
    from engine.serving import engine

    kept = []  # the compile cache's folder (use_compile_cache: set by the engine, left alone here)
    monkeypatch.setattr(engine, "use_compile_cache", kept.append)
    cfg = EngineConfig(flow_precompiled=True, flow_attention=attention)
    graphed = engine._graphed_flow(tiny_flow("cosyvoice3").decoder, "cosyvoice3", cfg, tmp_path)
    run = graphed.solver.estimator.run
    assert kept == [tmp_path / folder] and isinstance(run, Precompiled)
    assert run.root == tmp_path / folder / "precompiled"
    off = EngineConfig(flow_precompiled=False)
    assert not isinstance(_run(engine._graphed_flow, off, tmp_path), Precompiled)


@pytest.mark.parametrize("cfg", [{"flow_compile": False}, {"flow_aot": True}])
def test_nothing_is_kept_where_torch_compile_does_not_compile_the_flow(tmp_path, monkeypatch, cfg):
    """On by default: with the flow eager, or its programs from AOT packages, there is nothing to keep."""
    from engine.config import EngineConfig
    from engine.serving import engine

    monkeypatch.setattr(engine, "use_compile_cache", lambda folder: None)
    assert EngineConfig().flow_precompiled is True
    assert not isinstance(_run(engine._graphed_flow, EngineConfig(**cfg), tmp_path), Precompiled)
    assert not (tmp_path / "compile" / "precompiled").exists()


def _run(graphed_flow, cfg, root):
    return graphed_flow(tiny_flow("cosyvoice3").decoder, "cosyvoice3", cfg, root).solver.estimator.run


def test_v2s_unet_compiles_whole_and_matches_eager(tmp_path):
    """v2's U-Net traces whole too (with Python floats specialised: aot_compile cannot restart for them)."""
    from engine.flow.unet import CausalConditionalDecoder

    unet = tiny_flow("cosyvoice2").decoder.estimator
    assert isinstance(unet, CausalConditionalDecoder)
    fallback = Eager(unet)
    run = Precompiled(CausalConditionalDecoder.forward, unet, tmp_path, "forward", fallback)
    assert_eager(run, unet, (2, 40), (3, 70))
    assert fallback.calls == 0 and [p.name[-6:] for p in tmp_path.iterdir()] == [".0.bin"]
