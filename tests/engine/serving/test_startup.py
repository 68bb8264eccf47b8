"""The start-up timeline: phases in the order they ended, with seconds since launch; /ready's JSON."""

from __future__ import annotations

import threading
import time

import pytest

from engine.serving.startup import Phase, Timeline


@pytest.fixture
def tiny_cfg(tmp_path, monkeypatch):
    """The tiny v3 model on the CPU (native LM), its caches under ``tmp_path``: the compile-cache variables
    the load points under its cache root are undone after the test."""
    from engine.cache_root import COMPILE_DIRS
    from engine.config import EngineConfig
    from engine.demo.make_model import build_model_dir

    for name in COMPILE_DIRS:
        monkeypatch.setenv(name, str(tmp_path / name))
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    return EngineConfig(model=str(model_dir), device="cpu", backend="native", cache_dir=str(tmp_path / "c"))


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_phases_are_recorded_in_order_with_their_seconds_since_launch():
    clock = Clock()
    timeline = Timeline(origin=100.0, clock=clock)
    with timeline.phase("weights"):
        clock.t += 2.0
    clock.t += 0.5
    with timeline.phase("LM backend"):
        assert timeline.pending() == ["LM backend"]
        clock.t += 3.0
    timeline.mark_ready()
    clock.t += 1.0
    timeline.mark_ready()  # a second warm-up does not move it
    with timeline.phase("flow graphs", background=True):
        clock.t += 4.0
    assert timeline.phases == [
        Phase("weights", 0.0, 2.0),
        Phase("LM backend", 2.5, 3.0),
        Phase("flow graphs", 6.5, 4.0, background=True),
    ]
    body = timeline.as_dict()
    assert body["ready_s"] == 5.5 and body["now_s"] == 10.5 and body["pending"] == []
    assert [p["name"] for p in body["phases"]] == ["weights", "LM backend", "flow graphs"]  # type: ignore[union-attr]


def test_a_phase_that_fails_is_not_recorded_and_not_left_pending():
    timeline = Timeline()
    with pytest.raises(RuntimeError), timeline.phase("weights"):
        raise RuntimeError("no such file")
    assert timeline.phases == [] and timeline.pending() == [] and timeline.ready_s is None


def test_phases_from_threads_all_land(caplog):
    timeline = Timeline()
    gate = threading.Barrier(4)

    def work(n: int) -> None:
        with timeline.phase(f"part {n}"):
            gate.wait(30)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    with caplog.at_level("INFO", "engine.serving.startup"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(p.name for p in timeline.phases) == [f"part {n}" for n in range(4)]
    assert sum("start-up: part" in r.getMessage() for r in caplog.records) == 8  # started, took


def test_the_weights_load_while_the_tokenizer_loads(tiny_cfg, monkeypatch):
    """The weights begin loading on their own thread before the tokenizer's load ends: a tokenizer load that
    returns only once the weights' load has begun lets the engine load; one waited for by it would fail."""
    import engine.serving.engine as engine_module
    from engine.serving.engine import TTSEngine

    loading = threading.Event()
    load_model, load_tokenizer = engine_module.load_model, engine_module.load_tokenizer

    def load(*args, **kwargs):
        loading.set()
        return load_model(*args, **kwargs)

    def tokenizer(*args, **kwargs):
        assert loading.wait(10), "the weights did not start loading during the tokenizer's load"
        return load_tokenizer(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", load)
    monkeypatch.setattr(engine_module, "load_tokenizer", tokenizer)
    eng = TTSEngine.load(tiny_cfg)
    eng.close()
    assert {"weights", "tokenizer"} <= {p.name for p in eng.startup.phases}


@pytest.mark.parametrize("onto", [True, False])
def test_the_engine_asks_the_load_for_the_reader_its_config_names(tiny_cfg, monkeypatch, onto):
    """EngineConfig.weights_onto_device reaches load_model (``--no-weights-onto-device``: the A/B's other
    arm, memory-mapped as before)."""
    import dataclasses

    import engine.serving.engine as engine_module
    from engine.serving.engine import TTSEngine

    asked: list[bool] = []
    load_model = engine_module.load_model

    def load(files, dev, cache, onto_device):
        asked.append(onto_device)
        return load_model(files, dev, cache, onto_device)

    monkeypatch.setattr(engine_module, "load_model", load)
    TTSEngine.load(dataclasses.replace(tiny_cfg, weights_onto_device=onto)).close()
    assert asked == [onto]


def test_an_engine_on_the_native_loop_serves_without_importing_transformers(tiny_cfg):
    """transformers' import (2 s on this VM, 13-18 s on a GPU host with vLLM) is off the serving path: a
    fresh process loads the tiny engine and synthesises with Whisper off and never imports it."""
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import asyncio, sys
import numpy as np
from engine.config import EngineConfig
from engine.request import Mode, SynthesisRequest
from engine.serving.engine import TTSEngine
cfg = EngineConfig(model={tiny_cfg.model!r}, device="cpu", backend="native", cache_dir={tiny_cfg.cache_dir!r},
                   asr_model="none", text_workers=0)
eng = TTSEngine.load(cfg)
async def speak():
    await eng.warmup()
    prompt = (0.1 * np.random.default_rng(1).standard_normal(48000)).astype(np.float32), 24000
    req = SynthesisRequest(text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=3,
                           forced_tokens=20)
    return [c async for c in eng.stream(req)]
try:
    print(len(asyncio.run(speak())) > 0, sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
finally:
    eng.close()
"""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True []"


def test_a_phase_needs_a_name_and_no_negative_seconds():
    with pytest.raises(ValueError):
        Phase("", 0.0, 1.0)
    with pytest.raises(ValueError):
        Phase("weights", 0.0, -1.0)


async def test_a_loaded_engine_reports_its_phases_in_order_then_ready(tiny_cfg, monkeypatch):
    """The real load on the tiny model: every phase once, ordered by when it ended, the weights from the
    start, the LM backend after the tokenizer and beside the frontends, the first graphs after both, the
    warm-up last and ready at its end."""
    import json

    from engine.serving.engine import TTSEngine

    cfg = tiny_cfg
    timeline = Timeline()
    eng = TTSEngine.load(cfg, timeline=timeline)
    try:
        assert eng.startup is timeline and timeline.ready_s is None
        await eng.warmup()
    finally:
        eng.close()
    phases = {p.name: p for p in timeline.phases}
    assert sorted(phases) == sorted(
        [
            "model files",
            "weights",
            "tokenizer",
            "LM backend",
            "frontends",
            "text workers",
            "first graphs",
            "warm-up",
        ]
    )
    ends = [p.start_s + p.seconds for p in timeline.phases]
    assert ends == sorted(ends)  # listed in the order they ended

    def end(name: str) -> float:
        return phases[name].start_s + phases[name].seconds

    assert end("model files") <= phases["tokenizer"].start_s <= end("tokenizer")
    assert end("model files") <= phases["weights"].start_s
    # the LM starts from llm.pt after the tokenizer; the frontends once the weights are in
    assert end("tokenizer") <= phases["LM backend"].start_s and end("weights") <= phases["frontends"].start_s
    assert phases["first graphs"].start_s >= max(end("LM backend"), end("frontends"))
    # the text workers start beside the LM's start; load waits for what is left of it once the LM is up
    assert phases["text workers"].start_s >= end("LM backend")
    assert timeline.ready_s is not None and timeline.ready_s >= end("warm-up") >= end("first graphs")
    assert not any(p.background for p in timeline.phases) and eng.graph_builder.pending == 0
    assert json.loads(json.dumps(timeline.as_dict()))["ready_s"] == round(timeline.ready_s, 3)


@pytest.mark.parametrize("kept", [False, True], ids=["traced", "programs-kept"])
async def test_the_engine_is_ready_before_the_flow_compile_and_serves_exactly_through_it(
    tmp_path, monkeypatch, kept
):
    """Serve first, compile behind: with the compiled DiT the engine is ready on its eager twin's first graphs
    while the compile (a fake that holds until released) runs on the graph builder; a request meanwhile is
    served without it, and the same request after it replays the compiled graphs with the same audio."""
    import asyncio

    import numpy as np

    import engine.serving.engine as engine_module
    from engine.cache_root import COMPILE_DIRS
    from engine.config import EngineConfig, Limits
    from engine.demo.make_model import build_model_dir
    from engine.flow import compiled_estimator
    from engine.request import Mode, SynthesisRequest
    from engine.serving.engine import TTSEngine
    from tests.engine.test_graph_cache import Recorded, emulate_capture

    wait_s = 120.0  # generous: the machine is slow and shared
    for name in COMPILE_DIRS:
        monkeypatch.setenv(name, str(tmp_path / name))
    emulate_capture(monkeypatch)

    class WarmedUp(Recorded):
        """Runs its function once at capture, as CapturedCall's warm-up does (where a compile happens)."""

        def __init__(self, fn, inputs, *args, **kwargs):
            super().__init__(fn, inputs, *args, **kwargs)
            fn(*inputs)

    monkeypatch.setattr("engine.device.CapturedCall", WarmedUp)
    monkeypatch.setattr("engine.device.empty_cache", lambda dev: None)
    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)
    compiling, release = threading.Event(), threading.Event()
    compiled_calls: list[str] = []

    def slow_compile(fn):
        def run(*args):
            if not release.is_set():  # the first call compiles: held here
                compiling.set()
                assert release.wait(wait_s)
            compiled_calls.append(threading.current_thread().name)
            return fn(*args)

        return run

    if kept:  # the default: the programs kept whole (engine.flow.precompiled), compiled at their first call
        from engine.flow.precompiled import Precompiled

        monkeypatch.setattr(Precompiled, "__call__", _held(Precompiled.__call__, slow_compile))
    else:
        monkeypatch.setattr(compiled_estimator, "_compiled", slow_compile)
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", backend="native", cache_dir=str(tmp_path / "c"),
        flow_compile=True, hift_graphs=False, flow_reuse=False, graph_warmup_s=4.0, flow_batch=2,
        limits=Limits(max_concurrency=2), flow_precompiled=kept,
        t2w_first_lane=False,  # its graphs, the builder's last job (test_engine.py), are not this test's
    )  # fmt: skip
    prompt = (0.1 * np.random.default_rng(1).standard_normal(24000 * 2)).astype(np.float32), 24000
    req = SynthesisRequest(
        text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=3, forced_tokens=30
    )
    eng = TTSEngine.load(cfg)
    try:
        await eng.warmup()
        graphed = eng.model.flow.decoder
        assert compiling.wait(wait_s)
        assert eng.ready and eng.startup.ready_s is not None
        assert eng.startup.pending() == ["flow compile", "flow solver graphs"]  # ready before both
        # batch 1 and 2 x 100 frames x streaming, then the single-stream 200-frame ones, all eager
        assert not graphed.compiled and len(graphed.graphs) == 6
        during, _ = await eng.synthesize(req)
        assert compiled_calls == []  # served on the eager graphs, the compile still held
        release.set()
        assert await asyncio.to_thread(eng.graph_builder.wait, wait_s)
        assert graphed.compiled and len(graphed.graphs) == 8
        before = len(compiled_calls)
        after, _ = await eng.synthesize(req)
    finally:
        eng.close()
    assert set(compiled_calls[before:]) == {"token2wav"}  # replayed by the worker, nothing compiled there
    if kept:  # a real compile (Inductor, float32): each estimator call within test_precompiled's tolerance,
        # not bit-exact through ten solver steps and the vocoder's phase (~10 % RMS on the tiny random model)
        rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
        assert after.shape == during.shape and rms(after - during) < 0.25 * rms(during)
        assert list((tmp_path / "c" / "compile" / "precompiled").glob("*.bin"))  # kept for the next start
    else:
        np.testing.assert_allclose(after, during, atol=1e-6, rtol=0)
    background = [p.name for p in eng.startup.phases if p.background]
    assert background == ["flow solver graphs (1 stream)", "flow compile", "flow solver graphs"]
    compile_end = next(p.start_s + p.seconds for p in eng.startup.phases if p.name == "flow compile")
    assert eng.startup.ready_s < compile_end


@pytest.mark.parametrize(("wait_s", "release_after_s"), [(0.0, 0.3), (60.0, 0.3), (0.3, None)])
async def test_ready_waits_for_the_background_work_up_to_its_bound(tiny_cfg, wait_s, release_after_s):
    """EngineConfig.ready_graph_wait_s: 0 (the default), ready at once and the builder's jobs after it; else
    they run after the warm-up and ready waits for them, at most that long: a job still held then goes on
    behind ready (pending on /ready), and ends when released."""
    import dataclasses

    from engine.serving.engine import TTSEngine

    eng = TTSEngine.load(dataclasses.replace(tiny_cfg, ready_graph_wait_s=wait_s))
    began, release = threading.Event(), threading.Event()

    def held(stop: threading.Event) -> None:  # a capture job, held by the test
        began.set()
        release.wait(60.0)

    def release_later(after_s: float) -> None:  # the job's release, that long after it began
        if began.wait(60.0):
            time.sleep(after_s)
        release.set()

    eng.graph_builder.add("held graphs", held)
    if release_after_s is not None:
        threading.Thread(target=release_later, args=(release_after_s,), daemon=True).start()
    try:
        await eng.warmup()
        timeline = eng.startup
        assert eng.ready and timeline.ready_s is not None
        pending_at_ready = timeline.pending()
        release.set()
        assert eng.graph_builder.wait(60.0)
    finally:
        release.set()
        eng.close()
    phases = {p.name: p for p in timeline.phases}
    held = phases["held graphs"]
    if wait_s == 0.0:  # ready first, the job behind it
        assert "graphs before ready" not in phases and held.start_s >= timeline.ready_s
    elif release_after_s is not None:  # the job done within the bound: ready after it, nothing pending
        assert pending_at_ready == [] and held.start_s + held.seconds <= timeline.ready_s
        assert held.seconds >= 0.25  # it did wait for the release
    else:  # the bound first: ready with the job still running
        assert pending_at_ready == ["held graphs"]
        waited = phases["graphs before ready"].seconds
        assert 0.3 <= waited < 30.0 and held.start_s < timeline.ready_s < held.start_s + held.seconds


async def test_the_background_graphs_are_paced_by_this_engines_streams(tiny_cfg, monkeypatch):
    """At ready the graph builder is told to capture only where no stream can stall for it: with the
    engine idle, or with every stream in it holding ``CAPTURE_SLACK_S`` of audio at its client; else it
    waits (its bound, then it goes ahead: False), and wakes at once when the last request ends."""
    from engine.graph_builder import GraphBuilder
    from engine.serving.engine import CAPTURE_SLACK_S, TTSEngine, _Active

    paced: list = []
    monkeypatch.setattr(GraphBuilder, "yield_to", lambda self, clear: paced.append(clear))
    eng = TTSEngine.load(tiny_cfg)
    try:
        assert paced == []  # nothing paces the load itself
        await eng.warmup()
        [clear] = paced
        assert clear(0.0)  # idle
        await eng.admission.acquire()
        stream = _Active("r1")  # admitted, no audio yet (its first chunk is still coming)
        eng._active.add(stream)
        t0 = time.monotonic()
        assert not clear(0.05) and time.monotonic() - t0 >= 0.05  # waited its bound
        stream.playback.delivered(CAPTURE_SLACK_S - 1.0)  # playing, too little buffered
        assert not clear(0.0)
        stream.playback.delivered(2.0)  # now CAPTURE_SLACK_S + 1 s ahead of its player
        assert clear(0.0)  # busy, yet no stream can stall
        stream.playback.runs_out_at = time.perf_counter() + 0.5
        stream.playback.finished = True  # all its audio delivered: nothing more to wait for
        assert clear(0.0)
        stream.playback.finished = False
        ended = threading.Timer(0.1, lambda: (eng._active.discard(stream), eng.admission.release()))
        ended.start()
        t0 = time.monotonic()
        assert clear(30.0) and time.monotonic() - t0 < 5.0  # woken by the end of the last request
        ended.join()
    finally:
        eng.close()


class _HeldTranscriber:
    """Stands in for Whisper: ``transcribe`` answers at once; its load blocks until ``release``."""

    name = "held-whisper"

    def transcribe(self, audio: object, language: str | None = None) -> str:
        return f"heard ({language})"

    def words(self, pcm: object, sample_rate: int, language: str | None = None) -> list:
        from engine.serving.subtitles import Word

        return [Word("Hello.", 0.25, 0.75)]


async def test_whisper_loads_beside_the_warm_up_and_a_transcription_waits_for_it(
    tiny_cfg, tmp_path, monkeypatch
):
    """Only a prompt without its transcript needs Whisper: the engine is ready while it still loads (a
    background phase, pending on /ready), speech is served meanwhile, a transcription waits for the load;
    a load that fails leaves speech served and every transcription raising its error. The subtitles'
    word timer is the same loading Whisper."""
    import asyncio
    import dataclasses

    from engine.asr import Transcriber
    from engine.errors import ModelError
    from engine.request import Mode, SynthesisRequest
    from engine.serving.engine import TTSEngine
    from engine.serving.subtitles import Word, align_words
    from tests.sounds import speech_like

    release, outcome = threading.Event(), {"fail": False}

    def held_load(name: str, device: object) -> object:
        assert release.wait(30.0), "the test never released the load"
        if outcome["fail"]:
            raise ModelError(f"could not load the ASR model {name!r}")
        return _HeldTranscriber()

    monkeypatch.setattr(Transcriber, "load", staticmethod(held_load))
    req = SynthesisRequest(
        text="Hello.", mode=Mode.CROSS_LINGUAL, prompt_audio=(speech_like(2.0, 24000), 24000), seed=1
    )
    (tmp_path / "my-whisper").mkdir()  # a local folder: named by its own name
    for fail in (False, True):
        outcome["fail"] = fail
        release.clear()
        eng = TTSEngine.load(dataclasses.replace(tiny_cfg, asr_model=str(tmp_path / "my-whisper")))
        try:
            await eng.warmup()  # ready with Whisper still loading
            assert eng.startup.ready_s is not None and "whisper" in eng.startup.pending()
            assert eng.asr_model == "my-whisper"  # named before it has loaded
            heard = asyncio.ensure_future(eng.transcribe((speech_like(2.0, 16000), 16000), "en"))
            await asyncio.sleep(0.2)
            assert not heard.done()  # waiting for the load
            audio, _ = await eng.synthesize(req)  # speech is served meanwhile
            assert audio.size > 0
            release.set()
            timer, pcm = eng.word_timer, speech_like(1.0, 24000)
            assert timer is not None  # the subtitles' word timer: the same loading Whisper
            if fail:
                with pytest.raises(ModelError, match="my-whisper"):
                    await asyncio.wait_for(heard, 30.0)
                with pytest.raises(RuntimeError, match="did not load"):  # words then spread by letters
                    timer.words(pcm, 24000, "en")
                assert (await eng.synthesize(req))[0].size > 0  # and still after the failure
            else:
                assert await asyncio.wait_for(heard, 30.0) == "heard (en)"
                assert align_words("Hello.", pcm, 24000, timer) == [Word("Hello.", 0.25, 0.75)]
                assert "whisper" not in eng.startup.pending()
                assert [p.background for p in eng.startup.phases if p.name == "whisper"] == [True]
        finally:
            release.set()
            eng.close()


async def test_idle_work_runs_while_the_lm_starts_and_is_skipped_once_it_is_up(tiny_cfg, monkeypatch):
    """The server's studio import runs on the loading thread while it would only wait for the LM backend
    (vLLM's start), each job a phase ending before the backend's; with the backend already up, the jobs
    are left to the caller (nothing waits for them)."""
    import time as clock

    import engine.serving.engine as engine_module

    cfg = tiny_cfg
    real_backend, ran = engine_module._backend, []

    def slow_backend(*args: object) -> object:
        clock.sleep(2.0)  # a start that takes a while, as vLLM's does
        return real_backend(*args)

    monkeypatch.setattr(engine_module, "_backend", slow_backend)
    jobs = (("studio import", lambda: ran.append("studio")), ("more", lambda: ran.append("more")))
    timeline = Timeline()
    eng = engine_module.TTSEngine.load(cfg, timeline=timeline, idle_work=jobs)
    eng.close()
    phases = {p.name: p for p in timeline.phases}
    assert ran == ["studio", "more"]
    lm_end = phases["LM backend"].start_s + phases["LM backend"].seconds
    assert phases["frontends"].start_s <= phases["studio import"].start_s <= lm_end

    monkeypatch.setattr(engine_module, "_backend", real_backend)
    real_beside = engine_module._beside_the_lm

    def slow_beside(*args: object) -> object:
        done = real_beside(*args)
        clock.sleep(2.0)  # the native loop (up ~0.2 s after the weights) is surely up by now
        return done

    monkeypatch.setattr(engine_module, "_beside_the_lm", slow_beside)
    ran.clear()
    eng = engine_module.TTSEngine.load(cfg, timeline=Timeline(), idle_work=jobs)
    eng.close()
    assert ran == []  # nothing to wait for: left to the caller


async def test_background_captures_wait_while_a_stream_has_little_audio_buffered(tiny_cfg, monkeypatch):
    """The real engine's pace with a stream running (tiny v3 on the CPU, a stand-in job of five
    "captures" queued at load): no capture starts while the stream is in the engine with less than
    ``CAPTURE_SLACK_S`` of audio at its client, the first waits for it, and all five run by the end."""
    import asyncio

    from engine.request import Mode, SynthesisRequest
    from engine.serving.engine import CAPTURE_SLACK_S, TTSEngine
    from tests.sounds import speech_like

    cfg = tiny_cfg
    eng = TTSEngine.load(cfg)
    seen: list[tuple[float, list[float]]] = []  # (when, buffered s of each unfinished stream) at each start
    streaming = threading.Event()

    def captures(stop: threading.Event) -> None:
        assert streaming.wait(30.0)  # the first capture is asked for with the stream already running
        for _ in range(5):
            t0 = time.monotonic()
            stop.between()  # type: ignore[attr-defined]  # the builder hands its jobs a Pace
            buffered = [a.playback.buffered_s() for a in list(eng._active) if not a.playback.finished]
            seen.append((time.monotonic() - t0, buffered))

    eng.graph_builder.add("stand-in captures", captures)
    prompt = (speech_like(2.0, 24000), 24000)
    req = SynthesisRequest(
        text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=3, forced_tokens=300
    )
    try:
        await eng.warmup()  # starts the builder: its job waits for the stream below
        chunks = 0
        async for _ in eng.stream(req):
            chunks += 1
            streaming.set()
        assert await asyncio.to_thread(eng.graph_builder.wait, 60.0)
    finally:
        eng.close()
    assert chunks > 2 and len(seen) == 5
    assert all(all(b >= CAPTURE_SLACK_S - 0.1 for b in buffered) for _, buffered in seen), seen
    assert seen[0][0] > 0.05  # the first capture waited for the stream's buffer (or its end)


def test_text_workers_that_fail_to_start_fail_the_load_and_close_what_started(tiny_cfg, monkeypatch):
    """A worker that cannot start (its tokenizer unreadable, say) fails the load with its error after the
    LM is up, and the LM backend and the pool are closed: nothing is left running."""
    import dataclasses

    import engine.serving.engine as engine_module
    from engine.serving.engine import TTSEngine
    from engine.text.pool import TextPool

    closed: list[str] = []

    def broken(self, timeout_s: float = 120.0) -> None:
        raise RuntimeError("a text worker could not start")

    def backend(cfg, files, dev, weights):
        lm = original(cfg, files, dev, weights)
        monkeypatch.setattr(lm, "close", lambda: closed.append("LM"), raising=False)
        return lm

    original = engine_module._backend
    monkeypatch.setattr(engine_module, "_backend", backend)
    monkeypatch.setattr(TextPool, "wait_started", broken)
    monkeypatch.setattr(TextPool, "close", lambda self: closed.append("pool"))
    with pytest.raises(RuntimeError, match="could not start"):
        TTSEngine.load(dataclasses.replace(tiny_cfg, text_workers=1))
    assert sorted(closed) == ["LM", "pool"]


def _held(method, hold):
    """``method`` (an instance's call) behind ``hold`` (the test's fake compile: the first call waits)."""

    def call(self, *args):
        return hold(lambda *a: method(self, *a))(*args)

    return call


class _Stop(Exception):
    """Ends a load where the test has seen what it wanted."""


@pytest.mark.parametrize(("lm_host", "early"), [(True, True), (False, False)])
def test_dynamo_imports_beside_the_weights_unless_vllm_imports_it_here(monkeypatch, lm_host, early):
    """With the LM host (vLLM in a process of its own) the flow's compile cache is set, importing Dynamo
    (~3 s), before the weights are waited for; with vLLM in process its own import does that beside the
    weights, and a second thread importing Dynamo at once is avoided (set after the weights)."""
    from concurrent.futures import Future
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from engine.config import EngineConfig
    from engine.serving import engine as engine_module

    class Loading(Future):
        def result(self, timeout: float | None = None) -> object:
            assert self.done(), "waited for the weights before setting the compile cache"
            return super().result(timeout)

    weights = Loading()  # still loading
    seen: list[bool] = []

    def compile_cache(family: str, cfg: EngineConfig, cache: Path) -> Path:
        seen.append(weights.done())
        raise _Stop

    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)
    monkeypatch.setattr(engine_module.devices, "is_accelerator", lambda dev: True)
    monkeypatch.setattr(engine_module, "_flow_compile_cache", compile_cache)
    cfg = EngineConfig(model="demo-tiny", backend="vllm", lm_host=lm_host)
    files = SimpleNamespace(family="cosyvoice3")
    if not early:
        weights.set_exception(_Stop())  # the weights are waited for first: the load ends there
    with pytest.raises(_Stop):
        engine_module._beside_the_lm(cfg, files, torch.device("cpu"), None, None, weights, None, None)
    assert seen == ([False] if early else [])
