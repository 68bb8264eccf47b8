"""The first-chunk lane (engine.serving.first_lane, Token2Wav.open_first_lane): a second token2wav worker
that takes streaming requests' first chunks while the main worker is busy, with graphs of its own; the
same audio either way. The tiny model's real flow and vocoder on the CPU; the graphs' capture emulated."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from engine.checkpoint import load_model
from engine.config import StreamConfig
from engine.demo.make_model import build_model_dir
from engine.flow.graphs import WINDOW, GraphedCFM
from engine.hub import validate_model_dir
from engine.serving.first_lane import open_lane, with_decoder
from engine.serving.token2wav import FIRST_LANE, Token2Wav
from tests.conftest import WAIT_S
from tests.engine.serving.test_token2wav import two_streams
from tests.engine.test_graph_cache import emulate_capture


def tiny(tmp_path, family: str, graphed: bool, monkeypatch, device: str = "cpu"):
    """The family's tiny model on ``device``; ``graphed``: its solver the CUDA-graph one with a page pool
    (on the CPU, capture emulated)."""
    dev = torch.device(device)
    model = load_model(validate_model_dir(build_model_dir(tmp_path, family, "tiny")), dev)
    if graphed and dev.type == "cpu":
        emulate_capture(monkeypatch)
        monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    if graphed:
        model.flow.decoder = solver = GraphedCFM(model.flow.decoder)  # type: ignore[assignment]
        assert solver.enable_reuse(2**30, 800, model.device) > 0
        solver.precapture(2, 400, model.device)
    return model


def beside_a_held_call(
    tmp_path, family: str, lane: bool, graphed: bool, monkeypatch, device: str = "cpu", urgent: bool = False
):
    """Stream a's second chunk (6 s of audio buffered) is held in the main worker's call when stream b's
    first chunk is queued; with ``lane`` the lane is open (on its high-priority stream with ``urgent``).
    -> (the three chunks' audio, whether b's first chunk was done while a's call was still held, the worker
    b's first chunk ran on, b's vocoder state tensors after it)."""
    model = tiny(tmp_path, family, graphed, monkeypatch, device)
    clock = [0.0]
    t2w = Token2Wav(model.flow, model.hift, family, model.device, StreamConfig(), clock=lambda: clock[0])
    t2w.lane_urgent = urgent
    if lane:
        open_lane(t2w, model.flow, None, 400, model.device)
        assert t2w.first_lane
    flow, in_call, go = t2w._flow, threading.Event(), threading.Event()

    def held(utts, chunks):  # a later chunk's call waits after its flow until released
        mels = flow(utts, chunks)
        if chunks[0].mel_start > 0:
            in_call.set()
            assert go.wait(timeout=WAIT_S)
        return mels

    t2w._flow = held  # type: ignore[method-assign]

    async def scenario():
        a, b, jobs_a, job_b = two_streams(t2w, family)
        first_a = await t2w.run(a, jobs_a[0])
        second_a = asyncio.ensure_future(t2w.run(a, jobs_a[1], 6.0))
        assert await asyncio.to_thread(in_call.wait, WAIT_S)
        first_b = asyncio.ensure_future(t2w.run(b, job_b))
        done, _ = await asyncio.wait([first_b], timeout=0.5 if not lane else WAIT_S)
        beside = bool(done)
        go.set()
        audio = [first_a, *await asyncio.gather(second_a, first_b)]
        assert b.last_times is not None
        return audio, beside, b.last_times.lane, b.vocoder.tensors()

    try:
        return asyncio.run(scenario())
    finally:
        t2w.close()
        assert not t2w.healthy  # both workers ended


@pytest.mark.parametrize("family", ["cosyvoice3", "cosyvoice2"])
def test_a_first_chunk_runs_on_the_lane_beside_a_held_call_with_the_same_audio(tmp_path, family, monkeypatch):
    """With the lane open, a new stream's first chunk is served while the main worker's call is still
    held, on the lane; without it, it waits for that call. The audio of every chunk is the same."""
    handed: list[tuple[torch.Tensor, object]] = []
    monkeypatch.setattr("engine.serving.token2wav.devices.used_on", lambda t, on: handed.append((t, on)))
    with_lane, beside, worker, kept = beside_a_held_call(tmp_path / "a", family, True, False, monkeypatch)
    alone, waited, main, _ = beside_a_held_call(tmp_path / "b", family, False, False, monkeypatch)
    assert beside and worker == FIRST_LANE and not waited and main == "main"
    # what the lane left in b's state is handed to the main worker's streams (None: the CPU has none)
    assert kept and {id(t) for t in kept} <= {id(t) for t, _ in handed}
    assert {on for _, on in handed} == {None}
    for got, want in zip(with_lane, alone, strict=True):
        assert got.size > 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("urgent", [False, True])
def test_the_lane_runs_each_call_on_the_stream_lane_urgent_picks_after_the_others_work(
    tmp_path, monkeypatch, urgent
):
    """The lane keeps two streams (normal, high-priority) and runs each batch on the one ``lane_urgent``
    picks, ordered after the other's work (CPU: stand-ins record it, named by the thread that made them:
    the main worker keeps one of its own; the same audio either way)."""
    import contextlib

    made: list[bool] = []
    entered: list[tuple[object, object]] = []

    def worker_stream(device, urgent=False):
        if threading.current_thread().name != "token2wav-first":
            return "main-stream"
        made.append(urgent)
        return f"stream-{'urgent' if urgent else 'normal'}"

    def on_stream(stream, after=None):
        entered.append((stream, after))
        return contextlib.nullcontext()

    monkeypatch.setattr("engine.serving.token2wav.devices.worker_stream", worker_stream)
    monkeypatch.setattr("engine.serving.token2wav.devices.on_stream", on_stream)
    audio, beside, worker, _ = beside_a_held_call(
        tmp_path, "cosyvoice3", True, False, monkeypatch, urgent=urgent
    )
    assert beside and worker == FIRST_LANE and made == [False, True]
    picked, other = ("stream-urgent", "stream-normal")[:: 1 if urgent else -1]
    lanes = [e for e in entered if "main-stream" not in e]  # the main worker's: on the default stream
    assert lanes and set(lanes) == {(picked, other)}  # b's first chunk (a's too, where the lane took it)
    assert set(entered) - set(lanes) <= {(None, "main-stream")}
    assert all(a.size > 0 for a in audio)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_urgent_lane_runs_on_a_high_priority_stream(tmp_path, monkeypatch):
    """lane_urgent: the lane's flow call runs on a stream of a higher priority (a lower number) than the
    default stream's, where the main worker runs; the audio within 1e-4 of the normal stream's."""
    seen: list[tuple[str, int]] = []
    real = Token2Wav._run_batch

    def spy(self, jobs):
        seen.append((threading.current_thread().name, torch.cuda.current_stream().priority))
        return real(self, jobs)

    monkeypatch.setattr(Token2Wav, "_run_batch", spy)
    v3, args = "cosyvoice3", (True, True, monkeypatch, "cuda")
    urgent, beside, worker, _ = beside_a_held_call(tmp_path / "a", v3, *args, urgent=True)
    first_run, seen[:] = list(seen), []
    normal, *_ = beside_a_held_call(tmp_path / "b", v3, *args, urgent=False)
    assert beside and worker == FIRST_LANE

    def priorities(calls: list[tuple[str, int]], lane: bool) -> set[int]:
        return {prio for name, prio in calls if (name == "token2wav-first") is lane}

    default = torch.cuda.default_stream().priority
    lane_first = priorities(first_run, True)
    assert len(lane_first) == 1 and max(lane_first) < default  # a lower number is a higher priority
    assert priorities(seen, True) == {default} == priorities(first_run + seen, False)
    for got, want in zip(urgent, normal, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_through_the_graphed_solver_the_lane_replays_graphs_of_its_own(tmp_path, monkeypatch):
    """Through the CUDA-graph solver and its page pool (capture emulated): the lane's twin graphs (batch 1,
    a first chunk's window after no cached frame) serve its first chunk beside the held call, the pages
    shared with the main worker's; the same audio as with one worker."""
    with_lane, beside, worker, _ = beside_a_held_call(tmp_path / "a", "cosyvoice3", True, True, monkeypatch)
    alone, *_ = beside_a_held_call(tmp_path / "b", "cosyvoice3", False, True, monkeypatch)
    assert beside and worker == FIRST_LANE
    for got, want in zip(with_lane, alone, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_twin_graphs_are_a_first_chunks_own_and_leave_the_main_ones(tmp_path, monkeypatch):
    """``GraphedCFM.twin`` + ``precapture_first``: batch-1 window graphs at the narrowest prefix, every
    frame bucket up to the limit, in a cache of their own; the main graphs and solver are untouched, a later
    swap of the main solver does not reach the twin, and ``with_decoder`` leaves the model's flow alone."""
    model = tiny(tmp_path, "cosyvoice3", True, monkeypatch)
    main = model.flow.decoder
    assert isinstance(main, GraphedCFM)
    before = set(main.graphs.keys())
    twin = main.twin()
    assert twin.precapture_first(300, model.device) == 3
    assert set(twin.graphs.keys()) == {(1, f, WINDOW, main.prefix_buckets[0]) for f in (100, 200, 300)}
    assert set(main.graphs.keys()) == before and twin.pool is main.pool and twin.solver is main.solver
    lane_flow = with_decoder(model.flow, twin)
    assert lane_flow.decoder is twin and model.flow.decoder is main
    assert lane_flow.pre_lookahead_layer is model.flow.pre_lookahead_layer  # shared, not copied
    main.solver = main.cfm.with_estimator(main.solver.estimator)
    assert twin.solver is not main.solver


def test_with_kept_voices_the_lane_also_captures_windows_after_a_voices_prompt(tmp_path, monkeypatch):
    """EngineConfig.flow_voice_pages: a kept voice's first chunk starts after 3-4 prompt pages, so the lane's
    graphs also cover the next prefix width (Token2Wav marks the solver before the lane opens)."""
    model = tiny(tmp_path, "cosyvoice3", True, monkeypatch)
    main = model.flow.decoder
    assert isinstance(main, GraphedCFM) and not main.voice_windows
    t2w = Token2Wav(model.flow, model.hift, "cosyvoice3", model.device, StreamConfig(), voice_pages=True)
    t2w.close()
    assert main.voice_windows
    twin = main.twin()
    assert twin.precapture_first(300, model.device) == 6
    widths = main.prefix_buckets[:2]
    assert set(twin.graphs.keys()) == {(1, f, WINDOW, w) for f in (100, 200, 300) for w in widths}


def test_the_lane_is_switched_and_refused_before_it_is_opened(tmp_path, monkeypatch):
    model = tiny(tmp_path, "cosyvoice3", False, monkeypatch)
    t2w = Token2Wav(model.flow, model.hift, "cosyvoice3", model.device, StreamConfig())
    try:
        assert not t2w.first_lane
        with pytest.raises(RuntimeError, match="open_first_lane"):
            t2w.first_lane = True
        t2w.open_first_lane(model.flow, None)
        assert t2w.first_lane and t2w.healthy
        t2w.first_lane = False
        assert not t2w.first_lane and t2w.healthy
        with pytest.raises(RuntimeError, match="already open"):
            t2w.open_first_lane(model.flow, None)
    finally:
        t2w.close()


def test_the_servers_flags_set_the_lane_and_leave_it_auto_unset():
    from server import cli

    lane = [cli.engine_config(cli.parse_args(f)).t2w_first_lane for f in ([], ["--t2w-first-lane"])]
    assert lane == [None, True]
    assert cli.engine_config(cli.parse_args(["--no-t2w-first-lane"])).t2w_first_lane is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_lane_runs_beside_a_held_call_on_its_own_stream_and_graphs(tmp_path, monkeypatch):
    """Real CUDA graphs and streams: the lane's twin graphs on its own stream serve a first chunk while the
    main worker's call is held, the page pool shared; the audio within 1e-4 of one worker's."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    v3 = "cosyvoice3"
    with_lane, beside, worker, _ = beside_a_held_call(tmp_path / "a", v3, True, True, monkeypatch, "cuda")
    alone, *_ = beside_a_held_call(tmp_path / "b", v3, False, True, monkeypatch, "cuda")
    assert beside and worker == FIRST_LANE
    for got, want in zip(with_lane, alone, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_on_a_gpu_the_lane_needs_the_graphed_solver(tmp_path, monkeypatch):
    """The eager solver's per-request frame caches would cross the workers' streams: on an accelerator the
    lane is refused without the graphed solver (a clear reason), allowed with it, and always on the CPU."""
    from engine.serving.first_lane import refusal

    model = tiny(tmp_path, "cosyvoice3", False, monkeypatch)
    assert refusal(model.flow, model.device) is None
    monkeypatch.setattr("engine.serving.first_lane.devices.is_accelerator", lambda dev: True)
    assert "graphed flow solver" in (refusal(model.flow, model.device) or "")
    graphed = with_decoder(model.flow, GraphedCFM(model.flow.decoder))
    assert refusal(graphed, model.device) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_on_cuda_the_engine_serves_a_streams_first_chunk_on_the_lane(tmp_path, monkeypatch):
    """The whole engine on CUDA (the tiny v3, the native LM, the flow's graphs captured at load and the lane
    opened with them, as by default): with the main worker kept from taking a batch, a stream's first audio
    still comes, from the lane (the engine marks it a first chunk); the later chunks from the main worker
    once it takes again; the audio within 1e-4 of a one-worker engine's."""
    from engine.config import EngineConfig
    from engine.request import Mode, SynthesisRequest
    from engine.serving.engine import TTSEngine
    from engine.serving.token2wav import ChunkScheduler
    from tests.sounds import speech_like

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    gate, take = threading.Event(), ChunkScheduler.next_batch

    def gated(self):  # the main worker's take, held until the first audio is out
        assert gate.wait(WAIT_S)
        return take(self)

    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    prompt = (speech_like(3.0, 24000), 24000)
    req = SynthesisRequest(
        text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=3, forced_tokens=120
    )

    async def serve(lane: bool | None) -> list:
        cfg = EngineConfig(
            model=str(model_dir), device="cuda", backend="native", flow_compile=False, graph_warmup_s=4.0,
            background_graphs=False, t2w_first_lane=lane, voices_dir=str(tmp_path / f"voices-{lane}"),
        )  # fmt: skip
        engine = TTSEngine.load(cfg)
        engine.ready = True
        try:
            assert engine.token2wav.first_lane is (lane is not False)  # None: auto, on for v3 on CUDA
            stream = engine.stream(req)
            first = await asyncio.wait_for(anext(stream), WAIT_S)
            gate.set()
            return [first, *[c async for c in stream]]
        finally:
            gate.set()
            engine.close()

    monkeypatch.setattr(ChunkScheduler, "next_batch", gated)
    laned = await serve(None)
    monkeypatch.setattr(ChunkScheduler, "next_batch", take)
    alone = await serve(False)
    lanes = [c.trace.lane for c in laned if c.trace is not None]
    assert lanes[0] == FIRST_LANE and set(lanes[1:]) == {"main"} and len(lanes) > 2
    got, want = (np.concatenate([c.pcm for c in chunks]) for chunks in (laned, alone))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
