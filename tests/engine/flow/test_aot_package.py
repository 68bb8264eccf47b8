"""The flow's ahead-of-time programs (engine.flow.aot_package): built by a child process into the cache
root, found there on the next start, bound to the serving weights (not the random ones they were built
with), swapped in by the "flow compile" job while the eager twin serves, and a failed build leaves the
eager twin serving. On CPU (AOTInductor compiles C++ here; g++ is needed), the capture emulated."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
import torch

from engine.flow.aot_package import AotBuild, AotSpec
from engine.flow.compiled_estimator import CompiledEstimator
from engine.flow.graphs import WINDOW, AotRoot, GraphedCFM, _page_sizes
from engine.graph_builder import GraphBuilder
from engine.serving.startup import Timeline
from tests.engine.flow.test_dit_cache import tiny_flow, voice
from tests.engine.flow.test_dit_pages import WarmedUp, stream
from tests.engine.test_graph_cache import emulate_capture

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="AOTInductor on the CPU needs g++")
WAIT_S = 600.0
CPU = torch.device("cpu")


def graphed_flow(monkeypatch, root, family: str = "cosyvoice3"):
    """The family's tiny flow served by a graphed, compiled solver whose programs come from ``root``,
    with a page pool (v3) -> (flow, graphed)."""
    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    flow = copy.deepcopy(tiny_flow(family))
    graphed = GraphedCFM(flow.decoder, torch.float32, compiled=True, aot=AotRoot(root))
    sizes = _page_sizes(graphed.cfm)
    if family == "cosyvoice3" and sizes is not None:
        from engine.flow.dit_pages import PageLayout

        steps, depth, heads, dim_head, mel, chunk, _, states = sizes
        graphed.enable_reuse(
            63 * PageLayout.page_bytes(steps, depth, heads, dim_head, mel, chunk, states), 800, CPU
        )
    flow.decoder = graphed  # type: ignore[assignment]
    monkeypatch.setattr("engine.device.CapturedCall", WarmedUp)
    return flow, graphed


def test_a_child_process_builds_the_programs_and_the_compile_job_swaps_them_in(monkeypatch, tmp_path):
    """Serve first on the eager twin; the "flow compile" job waits for the child that builds the final and
    page-window programs, loads them bound to the serving weights, captures them and swaps; a stream after
    it emits what recomputing emits. A second start finds the packages, starts no child, and serves them
    from its first graphs on."""
    from engine.flow import aot_package

    ran = []  # every call of a loaded program passes its inputs through _contiguous
    dense = aot_package._contiguous
    monkeypatch.setattr(aot_package, "_contiguous", lambda args: ran.append(len(args)) or dense(args))
    flow, graphed = graphed_flow(monkeypatch, tmp_path)
    timeline = Timeline()
    builder = GraphBuilder(timeline)
    assert graphed.precapture(2, 300, CPU, builder.add) == 14
    first = graphed.graphs.keys()
    assert not graphed.compiled and {k[2] for k in first} == {WINDOW, False} and ran == []
    builder.start()
    assert builder.wait(WAIT_S) and graphed.compiled
    assert [p.name for p in timeline.phases][1] == "flow compile"
    assert isinstance(graphed.solver.estimator, CompiledEstimator)
    ran.clear()
    stream(flow, voice(13, seed=6), [41, 90, 120], graphed.frame_cache(None))  # type: ignore[arg-type]
    assert set(ran) == {12}  # the page-window program ran the streaming calls (its 12 inputs)
    spec = AotSpec.of(graphed.cfm, torch.float32, CPU, cudnn=False, paged=True)
    assert spec.programs == ("final", "paged")
    again = AotBuild(spec, tmp_path).start()
    assert again.done and again.process is None and again.wait()
    assert sorted(p.name for p in again.path.iterdir()) == ["final.pt2", "paged.pt2", "programs.json"]
    # a warm start: the programs load at once, before the first graphs, and there is nothing to swap
    flow, warm = graphed_flow(monkeypatch, tmp_path)
    timeline = Timeline()
    builder = GraphBuilder(timeline)
    assert warm.precapture(2, 300, CPU, builder.add) == 14
    assert warm.compiled and "flow compile" not in timeline.pending()
    ran.clear()
    stream(flow, voice(13, seed=8), [41, 90], warm.frame_cache(None))  # type: ignore[arg-type]
    assert set(ran) == {12}
    builder.start()
    assert builder.wait(WAIT_S) and len(warm.graphs) == 14


def test_a_failed_build_says_why_and_the_eager_twin_keeps_serving(monkeypatch, tmp_path):
    flow, graphed = graphed_flow(monkeypatch, tmp_path)
    real = AotSpec.of(graphed.cfm, torch.float32, CPU, cudnn=False, paged=True)
    config = real.config.replace('"dim": 64', '"dim": 0')
    broken = dataclasses.replace(real, config=config)
    with pytest.raises(RuntimeError, match=r"(?s)exit status 1.*DiTConfig.dim must be >= 1"):
        AotBuild(broken, tmp_path).start().wait()
    monkeypatch.setattr(AotSpec, "of", classmethod(lambda cls, *args, **kw: broken))
    builder = GraphBuilder(Timeline())
    graphed.precapture(2, 300, CPU, builder.add)
    builder.start()
    assert builder.wait(WAIT_S) and not graphed.compiled  # logged; every graph captured of the eager twin
    assert len(graphed.graphs) == 14
    stream(flow, voice(13, seed=7), [41, 90], graphed.frame_cache(None))  # type: ignore[arg-type]


def test_the_key_follows_what_changes_the_traced_code():
    cfm = tiny_flow("cosyvoice3").decoder
    spec = AotSpec.of(cfm, torch.bfloat16, CPU, cudnn=False, paged=True)
    assert spec.key() == AotSpec.of(copy.deepcopy(cfm), torch.bfloat16, CPU, False, True).key()
    others = [
        AotSpec.of(cfm, torch.float32, CPU, cudnn=False, paged=True),
        AotSpec.of(cfm, torch.bfloat16, CPU, cudnn=True, paged=True),
        AotSpec.of(cfm, torch.bfloat16, CPU, cudnn=False, paged=False),
        dataclasses.replace(spec, folded=True),
        AotSpec.of(tiny_flow("cosyvoice2").decoder, torch.bfloat16, CPU, cudnn=False, paged=True),
    ]
    assert len({spec.key(), *(o.key() for o in others)}) == 6
    assert others[-1].estimator == "unet" and spec.dtype == "bfloat16" and spec.programs == ("final", "paged")
    with pytest.raises(ValueError, match="programs"):
        dataclasses.replace(spec, programs=("everything",))
    with pytest.raises(TypeError, match="Identity"):
        AotSpec.of(cfm.with_estimator(torch.nn.Identity()), torch.float32, CPU, cudnn=False, paged=False)


def test_a_stop_ends_the_wait_and_the_child(tmp_path):
    """The engine closing (the builder's stop) while the child compiles: the wait returns False within a
    slice and the child is gone."""
    import subprocess
    import sys
    import threading
    import time

    spec = AotSpec.of(tiny_flow("cosyvoice3").decoder, torch.float32, CPU, cudnn=False, paged=True)
    build = AotBuild(spec, tmp_path)
    build.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    assert build.wait(stop) is False
    assert time.monotonic() - t0 < 5.0 and build.process.poll() is not None and not build.done


def test_a_child_that_crashes_is_reported_by_its_signal(tmp_path):
    """A native crash in the child (a segfault in a compile or a load) leaves no Python error: the wait
    says which signal ended it, with the log's end (the child's faulthandler writes its stacks there)."""
    import subprocess
    import sys

    spec = AotSpec.of(tiny_flow("cosyvoice2").decoder, torch.float32, CPU, cudnn=False, paged=False)
    build = AotBuild(spec, tmp_path)
    log_file = build.path.with_name(f"{build.path.name}.log")
    log_file.write_text("compiling\n")
    crash = "import faulthandler, os, signal; faulthandler.enable(); os.kill(os.getpid(), signal.SIGSEGV)"
    with log_file.open("ab") as out:
        build.process = subprocess.Popen([sys.executable, "-c", crash], stderr=out)
    with pytest.raises(RuntimeError, match=r"(?s)killed by SIGSEGV.*compiling.*Fatal Python error"):
        build.wait()
