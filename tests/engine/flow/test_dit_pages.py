"""The CUDA-graph solver's frame reuse from a page pool (engine.flow.dit_pages; v2's U-Net also keeps its
convs' states there, engine.flow.unet_pages) emits what the full recompute emits: streamed calls, batches
whose rows have different cache boundaries, a pool that runs short, pages given back. On CPU the graphs'
capture is emulated (the captured function runs eagerly on its static buffers, as a replay would), so every
call goes through the bucket padding and the page tables. Scenarios marked ``families`` run for both."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch

from engine import device as devices
from engine.config import FLOW_ATTENTION
from engine.flow.cfm import CosyVoice3Flow, Flow, FlowBatch
from engine.flow.dit_pages import SCRATCH, PagedCache, PageLayout, PagePool
from engine.flow.graphs import WINDOW, GraphedCFM, _page_sizes
from tests.engine.flow.test_dit_cache import (
    CHUNK,
    check_a_batch_with_different_boundaries,
    families,
    run,
    tiny_flow,
    voice,
)
from tests.engine.test_graph_cache import Recorded, emulate_capture


def paged(
    monkeypatch,
    pages: int = 64,
    compiled: bool = False,
    family: str = "cosyvoice3",
    folded: bool = False,
    stepped: bool = False,
) -> tuple[Flow, GraphedCFM]:
    """A copy of the family's tiny flow whose solver is the graphed one with a pool of ``pages`` pages
    (``folded``: its attention rules folded into q/k dims; ``stepped``: graphs of one solver step)."""
    emulate_capture(monkeypatch)
    flow = copy.deepcopy(tiny_flow(family))
    if folded:
        flow.decoder.fold_attention()
    graphed = GraphedCFM(flow.decoder, torch.float32, compiled=compiled, stepped=stepped)
    sizes = _page_sizes(graphed.cfm)
    assert sizes is not None
    steps, depth, heads, dim_head, mel, chunk, _, states = sizes
    page = PageLayout.page_bytes(steps, depth, heads, dim_head, mel, chunk, states)
    assert graphed.enable_reuse((pages - 1) * page, 800, torch.device("cpu")) == pages
    flow.decoder = graphed  # type: ignore[assignment]
    return flow, graphed


class WarmedUp(Recorded):
    """Runs the function once before "capturing", as CapturedCall's warm-up does (so it compiles)."""

    def __init__(self, fn, inputs, pool=None, warmup=2, stream=None):
        fn(*inputs)
        super().__init__(fn, inputs, pool, warmup, stream)


def stream(flow, v, counts, cache: PagedCache, emitted: int = 0) -> list[int]:
    """Non-final calls on the first n tokens for n in counts, checking each call's new frames (``emitted``
    generated frames were before them) against the recomputing tiny flow -> each call's window start."""
    starts = []
    for n in counts:
        starts.append(cache.frames)
        got, want = run([v], [n], [cache], flow=flow), run([v], [n], family=family_of(flow))
        assert got.shape == want.shape
        torch.testing.assert_close(got[..., emitted:], want[..., emitted:], atol=1e-4, rtol=0)
        emitted = want.size(2)
    return starts


def family_of(flow: Flow) -> str:
    return "cosyvoice3" if isinstance(flow, CosyVoice3Flow) else "cosyvoice2"


@families
def test_streamed_calls_through_pages_emit_what_recomputing_emits(monkeypatch, family):
    flow, graphed = paged(monkeypatch, family=family)
    v, cache = voice(13, seed=0), graphed.frame_cache(None)  # type: ignore[arg-type]
    counts = (20, 41, 63, 90, 140, 201)  # frames 60, 102, 146, 200, 300, 422 (26 of them the prompt)
    assert stream(flow, v, counts, cache) == [0, 50, 100, 100, 200, 300]
    assert cache.frames == 400 and len(cache.pages) == 8 and SCRATCH not in cache.pages
    assert cache.queried == sum(v.frames(n) - s for n, s in zip(counts, [0, 50, 100, 100, 200, 300]))
    assert graphed.pool is not None and graphed.pool.held == 8
    cache.clear()
    assert graphed.pool.held == 0


@families
def test_a_batch_with_different_boundaries_equals_each_row_recomputed_alone(monkeypatch, family):
    flow, graphed = paged(monkeypatch, family=family)
    check_a_batch_with_different_boundaries(
        family, [graphed.frame_cache(None), graphed.frame_cache(None)], flow
    )  # type: ignore[arg-type]


@families
def test_a_short_pool_stops_a_cache_growing_and_the_audio_stays_exact(monkeypatch, family):
    flow, graphed = paged(monkeypatch, pages=3, family=family)  # the scratch page and two more
    a, b = graphed.frame_cache(None), graphed.frame_cache(None)  # type: ignore[arg-type]
    first = voice(13, seed=4)
    stream(flow, first, [41], a)  # 102 frames: both free pages
    assert (a.frames, len(a.pages)) == (100, 2) and graphed.pool is not None and graphed.pool.free == 0
    starts = stream(flow, voice(20, seed=5), [20, 41, 90], b)  # no page left: every call recomputes
    assert starts == [0, 0, 0] and b.frames == 0 and b.pages == []
    emitted = first.frames(41) - first.prompt_frames
    assert stream(flow, first, [90, 140], a, emitted) == [100, 100]  # keeps what it has
    del a
    gc.collect()  # a request dropped without its final call gives its pages back
    assert graphed.pool.free == 2


@families
def test_step_graphs_of_page_windows_write_and_emit_what_the_whole_solve_graphs_do(monkeypatch, family):
    """``stepped``: a window graph records one solver step, the pool's pages of that step read and written
    through the step index (``PagePool.at``). A stream's calls replay the step graphs of the windows and
    the final call and equal the whole solve's graphs to the bit, and the pages hold the same keys, values,
    x and conv states at every step."""
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    pair = [paged(monkeypatch, family=family, stepped=stepped) for stepped in (False, True)]
    made = emulate_capture(monkeypatch)
    for _, graphed in pair:
        assert graphed.precapture(2, 300, torch.device("cpu")) == 14
    # x, step, then the window's: noise, mu, cond, spks, start, total and the prefix, write and lead pages
    windows = [s for s in made[14:] if len(s) == 11]
    assert len(windows) == 2 * 4 and all(s[0] == s[2] and s[1] == (1,) for s in windows)
    v, outs = voice(13, seed=8), []
    for flow, graphed in pair:
        cache = graphed.frame_cache(None)  # type: ignore[arg-type]
        calls = [run([v], [n], [cache], flow=flow) for n in (41, 90, 120)]
        outs.append([*calls, run([v], [140], finalize=True, flow=flow)])
    assert len(made) == 28  # every call replayed a pre-captured graph
    for whole, stepped in zip(*outs):
        assert torch.equal(whole, stepped)
    pools = [graphed.pool for _, graphed in pair]
    assert pools[0] is not None and pools[1] is not None and pools[0].kv.abs().sum() > 0
    for name in ("kv", "x", "states"):
        assert torch.equal(getattr(pools[0], name), getattr(pools[1], name))
    emitted = 0
    for n, got in zip((41, 90, 120), outs[1]):  # and each call's new frames are the recompute's
        want = run([v], [n], family=family)
        torch.testing.assert_close(got[..., emitted:], want[..., emitted:], atol=1e-4, rtol=0)
        emitted = want.size(2)


def test_the_pool_hands_out_each_page_once_and_never_the_scratch_page():
    layout = PageLayout(2, 1, 1, 2, 80, CHUNK, 60, 4, torch.float32, torch.float32, torch.device("cpu"))
    pool = PagePool(layout)
    first, second = pool.take(2), pool.take(5)
    assert first == [1, 2] and second == [3] and pool.take(1) == []
    pool.give(first)
    assert sorted(pool.take(9)) == [1, 2] and pool.held == 3
    assert layout.lead_pages == 2
    with pytest.raises(ValueError, match="scratch"):
        PageLayout(2, 1, 1, 2, 80, CHUNK, 60, 1, torch.float32, torch.float32, torch.device("cpu"))


def test_precapture_records_window_graphs_and_calls_replay_them(monkeypatch):
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    flow, graphed = paged(monkeypatch)
    made = emulate_capture(monkeypatch)
    # batch 1, 2 x (final, and windows after up to 2 prefix pages, of 100-300 frames; windows after 3-8
    # pages up to half of 300 frames; none after 16 pages: a request of 300 frames never has them)
    assert graphed.precapture(2, 300, torch.device("cpu")) == len(made) == 2 * (3 + 3 + 1)
    keys = set(graphed.graphs._graphs)
    assert {k[2] for k in keys} == {WINDOW, False} and {k[3] for k in keys if k[2] == WINDOW} == {2, 8}
    v, cache = voice(13, seed=6), graphed.frame_cache(None)  # type: ignore[arg-type]
    stream(flow, v, [41, 90, 120], cache)
    assert len(made) == 14 and cache.frames == 250  # every call replayed a pre-captured window graph


@families
def test_before_its_window_is_captured_a_stream_replays_the_widest_window_graph(monkeypatch, family):
    """With only the first graphs captured (the rest left to the background builder), every streaming
    call replays the widest window graph of its prefix width (more queries, their pages the scratch
    page) instead of running op by op, and emits what recomputing emits."""
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    flow, graphed = paged(monkeypatch, family=family)
    made = emulate_capture(monkeypatch)
    replayed: list[tuple[int, ...]] = []
    replay = Recorded.replay

    def counted(self, *values):
        replayed.append(tuple(self.inputs[0].shape))  # the window's noise [B,80,Q]
        return replay(self, *values)

    monkeypatch.setattr(Recorded, "replay", counted)
    graphed.precapture(2, 300, torch.device("cpu"), lambda name, job: None)
    first = set(graphed.graphs._graphs)
    assert {(k[0], k[1]) for k in first if k[2] == WINDOW and k[3] == 2} == {(1, 300), (2, 300)}
    v, cache = voice(13, seed=6), graphed.frame_cache(None)  # type: ignore[arg-type]
    assert stream(flow, v, [41, 90, 120], cache) == [0, 100, 200]
    assert len(made) == len(first) and set(graphed.graphs._graphs) == first  # nothing captured on the way
    assert len(replayed) == 3 and all(shape[0] == 1 for shape in replayed)
    assert replayed[0] == (1, 80, 300)  # a 102-frame first window in the widest one


def test_windows_that_fail_to_compile_leave_the_full_streaming_graphs(monkeypatch, caplog):
    """A compiler failure on the page windows at load drops the pool (logged) and captures the streaming
    full-solve graphs instead: the service loads and its streams recompute."""
    from torch._dynamo.exc import BackendCompilerFailed

    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    _, graphed = paged(monkeypatch)
    monkeypatch.setattr("engine.device.CapturedCall", WarmedUp)

    def failing(*args):
        raise BackendCompilerFailed(lambda: None, RuntimeError("LoweringException"), None)

    monkeypatch.setattr(graphed.solver.estimator, "run_paged", failing)
    assert graphed.precapture(1, 100, torch.device("cpu")) == 2  # (1, 100) streaming and final
    assert graphed.pool is None and not graphed.reuses_frames
    assert set(graphed.graphs._graphs) == {(1, 100, True), (1, 100, False)}
    assert "did not compile" in caplog.text


@families
def test_the_compiled_estimator_computes_the_same_windows(monkeypatch, family):
    """Inductor (its CPU backend here) compiles the page windows: the same audio within 1e-4."""
    flow, graphed = paged(monkeypatch, compiled=True, family=family)
    cache = graphed.frame_cache(None)  # type: ignore[arg-type]
    assert stream(flow, voice(13, seed=7), [41, 90, 140], cache) == [0, 100, 200]


@families
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_folded_attention_windows_and_final_calls_emit_what_the_masked_recompute_emits(
    monkeypatch, family, compiled
):
    """flow_attention "folded": the page windows (eager, or compiled by Inductor's CPU backend) and the
    final call, with the rule in q/k dims and no mask tensor, equal the masked recompute within 1e-4."""
    flow, graphed = paged(monkeypatch, compiled=compiled, family=family, folded=True)
    v, cache = voice(13, seed=3), graphed.frame_cache(None)  # type: ignore[arg-type]
    assert stream(flow, v, [41, 90, 140], cache) == [0, 100, 200]
    final = run([v], [140], finalize=True, flow=flow)
    torch.testing.assert_close(final, run([v], [140], finalize=True, family=family), atol=1e-4, rtol=0)


@families
@pytest.mark.parametrize("folded", [False, True], ids=["mask", "folded"])
def test_precapture_compiles_the_windows_once_and_the_final_calls_once(monkeypatch, family, folded):
    """Load-time cost: every window bucket (batches 1-4, prefix widths 2 and 8) runs on one compiled program
    and the final calls on one more, with the dense masks or the folded rule (its shape check adds no
    program). With duck shaping, batch 4 (= the tiny model's heads) and width 2
    (= the k/v pair) were specialised and each new batch or width compiled again (5 programs for v3 here);
    with page tables of B rows, batch 1 was (3 programs). On the H200 a program costs 1-2.5 minutes."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    torch._dynamo.reset()
    _, graphed = paged(monkeypatch, compiled=True, family=family, folded=folded)
    monkeypatch.setattr("engine.device.CapturedCall", WarmedUp)
    before = counters["stats"]["unique_graphs"]
    assert graphed.precapture(4, 300, torch.device("cpu")) == 3 * 7
    assert {k[3] for k in graphed.graphs._graphs if k[2] == WINDOW} == {2, 8}
    assert counters["stats"]["unique_graphs"] - before <= 2


@families
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("attention", FLOW_ATTENTION)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_bf16_windows_stay_close_to_the_float32_recompute(family, compiled, attention):
    """The GPU fidelity guard of reuse: bf16 page windows (compiled, or eager) in real CUDA graphs vs the
    eager float32 full recompute with dense masks, each call's new frames as mel RMS error relative to the
    mel's std, for each flow_attention (passed on the H200 on 2026-12-01: mask for v3 and v2, compiled and
    eager; folded and cudnn eager for both, compiled for v3). cudnn: the graphs compile and capture under
    the kernel order, as the engine's do."""
    dev = torch.device("cuda")
    with devices.cudnn_attention(dev) if attention == "cudnn" else contextlib.nullcontext():
        _windows_against_the_recompute(family, compiled, attention == "folded", dev)


def _windows_against_the_recompute(family: str, compiled: bool, folded: bool, dev: torch.device) -> None:
    flow = copy.deepcopy(tiny_flow(family)).to(dev)
    reference = copy.deepcopy(flow)
    if folded:
        flow.decoder.fold_attention()
    graphed = GraphedCFM(flow.decoder, torch.bfloat16, compiled=compiled)
    assert graphed.enable_reuse(2**30, 800, dev) > 10
    flow.decoder = graphed  # type: ignore[assignment]
    v, cache = voice(13, seed=8), graphed.frame_cache(None)  # type: ignore[arg-type]
    emitted = 0
    for n in (41, 90, 140, 201):
        with torch.inference_mode():
            batch = FlowBatch(
                v.tokens[:, :n].to(dev),
                torch.tensor([n], device=dev),
                v.prompt.to(dev),
                torch.tensor([v.prompt.size(1)], device=dev),
                v.feat.to(dev),
                torch.tensor([v.prompt_frames], device=dev),
                v.embedding.to(dev),
            )
            got = flow.inference(batch, streaming=True, finalize=False, caches=[cache])
            want = reference.inference(batch, streaming=True, finalize=False)
        new, ref = got[..., emitted:], want[..., emitted:]
        assert torch.isfinite(new).all()
        assert ((new - ref).pow(2).mean().sqrt() / ref.std()).item() < 0.05
        emitted = want.size(2)
    # the windows ran as captured graphs, (queries, prefix pages): (200, 2), (100, 2), (100, 8), (200, 8)
    assert cache.frames == 400 and len(graphed.graphs) == 4


@families
def test_without_a_pool_the_compiled_solver_compiles_the_streaming_and_final_calls_once(monkeypatch, family):
    """v2's graphs recompute by default (no page pool): compiled (``--flow-compile``), every bucket of
    batches 1-4 runs on one program for the streaming calls and one for the final calls, so its cold start
    compiles two programs (three, with windows, ran past 460 s on the H200)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    torch._dynamo.reset()
    emulate_capture(monkeypatch)
    graphed = GraphedCFM(copy.deepcopy(tiny_flow(family)).decoder, torch.float32, compiled=True)
    monkeypatch.setattr("engine.device.CapturedCall", WarmedUp)
    before = counters["stats"]["unique_graphs"]
    assert graphed.precapture(4, 300, torch.device("cpu")) == 3 * 3 * 2
    assert graphed.pool is None and all(k[2] != WINDOW for k in graphed.graphs._graphs)
    assert counters["stats"]["unique_graphs"] - before == 2


@families
def test_a_folded_estimator_recomputes_streaming_calls_as_the_masked_one(family):
    """Without a pool (v2's default graphs, the eager solver), streaming calls run the whole estimator with
    the chunk rule folded: the same mel as with the dense mask."""
    flow = copy.deepcopy(tiny_flow(family))
    flow.decoder.fold_attention()
    v = voice(13, seed=4)
    torch.testing.assert_close(run([v], [90], flow=flow), run([v], [90], family=family), atol=1e-4, rtol=0)
    with pytest.raises(TypeError, match="DiT or U-Net"):
        flow.decoder.with_estimator(torch.nn.Identity()).fold_attention()


def test_a_background_compile_swaps_the_window_graphs_and_the_streams_stay_exact(monkeypatch):
    """Serve first: with a background builder the compiled estimator's first graphs (full solves and page
    windows) are the eager twin's, then its other single-stream graphs, then the "flow compile" job
    captures the compiled ones of every key captured by then (the compile held here by a fake until
    released) and swaps them in, and the other graphs are captured of it. A stream before, during and
    after the compile emits what recomputing emits."""
    import threading

    from engine.flow import compiled_estimator
    from engine.graph_builder import GraphBuilder
    from engine.serving.startup import Timeline

    wait_s = 120.0
    held, release, calls = threading.Event(), threading.Event(), []

    def slow_compile(fn):
        def run(*args):
            if not release.is_set():
                held.set()
                assert release.wait(wait_s)
            calls.append(threading.current_thread().name)
            return fn(*args)

        return run

    monkeypatch.setattr(compiled_estimator, "_compiled", slow_compile)
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    flow, graphed = paged(monkeypatch, compiled=True)
    monkeypatch.setattr("engine.device.CapturedCall", WarmedUp)
    timeline = Timeline()
    builder = GraphBuilder(timeline)
    assert graphed.precapture(2, 300, torch.device("cpu"), builder.add) == 14
    first = set(graphed.graphs.keys())
    assert not graphed.compiled and calls == [] and len(first) == 6  # eager twin: nothing compiled
    assert {k[2] for k in first} == {WINDOW, False}  # windows and final solves, batch 1 and 2
    builder.start()
    assert held.wait(wait_s)  # the compile job is inside its first capture
    # before it, the eager twin's single-stream graphs: a call during the tracing replays, not op by op
    keys_now = graphed.graphs.keys()
    singles = {k for k in keys_now if k[0] == 1}
    assert len(singles) == 7 and len(graphed.graphs) == 6 + 4 and calls == []
    v = voice(13, seed=6)
    stream(flow, v, [41, 90], graphed.frame_cache(None))  # type: ignore[arg-type]
    assert calls == [] and not graphed.compiled
    assert timeline.pending() == ["flow compile", "flow solver graphs"]  # the compile, then the rest
    release.set()
    assert builder.wait(wait_s) and graphed.compiled and len(graphed.graphs) == 14
    assert set(calls) == {"graph-builder"}  # compiled and captured there, not on a caller's thread
    captured = len(calls)
    stream(flow, v, [41, 90, 120], graphed.frame_cache(None))  # type: ignore[arg-type]
    assert len(calls) > captured  # the replays run the compiled windows
    names = ["flow solver graphs (1 stream)", "flow compile", "flow solver graphs"]
    assert [p.name for p in timeline.phases] == names
