"""TTSEngine end to end on tiny random-weight model directories (native backend, CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, Limits
from engine.demo.make_model import build_model_dir
from engine.errors import InvalidInput, NotFound, NotReady, TooLarge
from engine.lm.backend import LMRequest
from engine.request import Mode, SynthesisRequest
from engine.serving.engine import TTSEngine
from engine.serving.token2wav import FIRST_LANE, ChunkScheduler
from tests.conftest import WAIT_S
from tests.reliability.support import idle_state, wait_idle
from tests.sounds import speech_like, write_wav

TEXT = "Hello there, this is a short test sentence."


@pytest.fixture(autouse=True)
def no_fork_server(monkeypatch):
    """The tests here that route the LM to vLLM give it a stand-in, which makes no engine core: the load
    starts no real fork server for it (Python's one per process, whose preload the fork server's own tests
    choose)."""
    from engine.serving import engine as engine_module

    monkeypatch.setattr(engine_module.fork_server, "start", lambda *modules: None)


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = build_model_dir(root / "model", request.param, "tiny")
    cfg = EngineConfig(
        model=str(model_dir),
        device="cpu",
        backend="native",
        voices_dir=str(root / "voices"),
        limits=Limits(max_concurrency=4, max_queue=8),
    )
    eng = TTSEngine.load(cfg)
    eng.ready = True
    eng.prompt = write_wav(root / "prompt.wav", 3.0)
    yield eng
    eng.close()


def req(engine, **kw) -> SynthesisRequest:
    # forced_tokens bounds the compute: a random-weight LM rarely samples one of v2's 3 stop ids
    base = dict(
        text=TEXT, prompt_wav=str(engine.prompt), prompt_text="A prompt transcript.", seed=1, forced_tokens=40
    )
    return SynthesisRequest(**(base | kw))


async def collect(engine, r):
    return [c async for c in engine.stream(r)]


def pcm(chunks) -> np.ndarray:
    return np.concatenate([c.pcm for c in chunks])


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": Mode.ZERO_SHOT},
        {"mode": Mode.CROSS_LINGUAL},
        {"mode": Mode.INSTRUCT, "instruct_text": "Speak happily."},
        {"mode": Mode.VC, "text": ""},
    ],
    ids=["zero_shot", "cross_lingual", "instruct", "vc"],
)
async def test_every_mode_streams_audio_with_metrics(engine, kw, tmp_path):
    if kw["mode"] == Mode.VC:
        kw["source_wav"] = str(write_wav(tmp_path / "src.wav", 2.0, 16000, seed=3))
    chunks = await collect(engine, req(engine, **kw))
    audio = pcm(chunks)
    assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
    assert audio.size > 0 and np.isfinite(audio).all() and np.abs(audio).max() <= 0.99 + 1e-6
    m = chunks[-1].metrics
    assert (
        m.done and m.ttfa_ms is not None and m.ttfa_ms > 0 and m.audio_s == pytest.approx(audio.size / 24000)
    )
    assert m.rtf is not None and m.stage_ms["flow"] > 0 and m.stage_ms["hift"] > 0
    if kw["mode"] == Mode.VC:  # 2 s of source speech at 25 tokens/s -> 50 tokens -> 2 s of audio
        assert audio.size == 50 * 960
    else:
        assert m.lm_tokens > 0 and audio.size % 480 == 0
        assert m.text_tokens > 0  # the usage's input tokens: the text the LM read


@pytest.mark.parametrize("source_s", [2.0, 4.0, 8.0])
async def test_vc_with_an_example_voice_streams_the_whole_file_calls_frames(engine, source_s, tmp_path):
    """An example voice as the VC prompt: VC keeps the prompt untrimmed, and this one has a mel frame fewer
    than 2 a token. Streaming (its flow calls reuse their finished frames) runs to the end, and its chunks
    cover the whole-file call's frames, none repeated or skipped at a seam."""
    voice = Path(__file__).resolve().parents[3] / "assets" / "voices" / "en-amy.wav"
    features = engine.frontend.extract(str(voice), trim=False)
    assert len(features.prompt_mel) == 2 * len(features.speech_tokens) - 1  # the case at issue
    source = write_wav(tmp_path / "src.wav", source_s, 16000, seed=3)
    kw = {"mode": Mode.VC, "text": "", "prompt_wav": str(voice), "source_wav": str(source)}
    chunks = await collect(engine, req(engine, **kw))
    assert engine.token2wav.reuses_flow and len(chunks) >= 3  # 2+ audio chunks and the end: a seam
    whole = pcm(await collect(engine, req(engine, stream=False, **kw)))
    # 25 source tokens a second, 2 frames each, and the prompt's missing frame (generated: the reference's)
    assert pcm(chunks).size == whole.size == (int(source_s * 50) + 1) * 480


async def test_saved_voice_is_usable_and_deletable(engine):
    voice = engine.add_voice("Test Voice", str(engine.prompt), "A prompt transcript.")
    assert voice.id in [v.id for v in engine.list_voices()]
    chunks = await collect(engine, req(engine, prompt_wav=None, prompt_text="", voice_id=voice.id))
    direct = await collect(engine, req(engine))
    np.testing.assert_array_equal(pcm(chunks), pcm(direct))  # same features, same seed -> same audio
    engine.delete_voice(voice.id)
    with pytest.raises(NotFound):
        await collect(engine, req(engine, prompt_wav=None, voice_id=voice.id))


async def test_same_seed_same_audio_other_seed_other_audio(engine):
    a, b = pcm(await collect(engine, req(engine))), pcm(await collect(engine, req(engine)))
    c = pcm(await collect(engine, req(engine, seed=2)))
    np.testing.assert_array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)


async def test_the_hosts_prompt_table_gives_the_same_audio_without_the_devices_lookup(engine, monkeypatch):
    """EngineConfig.lm_host_prefix (the default): the LM's prompt embeddings gathered on the host reach the
    backend on the host, with no lookup on the LM's device (``_prefix`` unused); switched off, the lookup
    serves, and the audio is the same sample for sample."""
    from engine.serving import engine as engine_module

    assert engine.prompt_table is not None and engine.host_prefix
    prefixes, real, lookup = [], engine.backend.generate, engine_module._prefix
    monkeypatch.setattr(engine.backend, "generate", lambda r: prefixes.append(r.prefix) or real(r))
    monkeypatch.setattr(engine_module, "_prefix", lambda *a: pytest.fail("looked up on the device"))
    gathered = pcm(await collect(engine, req(engine)))
    assert prefixes and all(p.device.type == "cpu" for p in prefixes)
    calls: list[int] = []
    monkeypatch.setattr(engine, "host_prefix", False)
    monkeypatch.setattr(engine_module, "_prefix", lambda *a: calls.append(1) or lookup(*a))
    np.testing.assert_array_equal(pcm(await collect(engine, req(engine))), gathered)
    assert calls


async def test_a_kept_voices_requests_view_its_prompt_tensors_with_the_same_audio(engine, monkeypatch):
    """EngineConfig.t2w_kept_prompts: a voice's second request reuses the prompt tensors its first made (its
    Utterance views them, the fast start's cut included) and the audio is the per-request copies'."""
    copied = pcm(await collect(engine, req(engine)))
    assert engine.token2wav.prompts.size == 0  # off by default
    seen, make = [], engine.token2wav.utterance
    monkeypatch.setattr(engine.token2wav, "utterance", lambda *a, **k: seen.append(make(*a, **k)) or seen[-1])
    monkeypatch.setattr(engine.token2wav.prompts, "size", 4)
    for _ in range(2):
        np.testing.assert_array_equal(pcm(await collect(engine, req(engine))), copied)
    assert len(engine.token2wav.prompts) == 1
    first, second = seen[0], seen[-1]
    assert second.prompt_feat.untyped_storage().data_ptr() == first.prompt_feat.untyped_storage().data_ptr()
    assert second.embedding is first.embedding


async def test_the_flow_prompt_made_in_the_frontends_thread_gives_the_same_audio(engine, monkeypatch):
    """EngineConfig.t2w_prompt_in_frontend: the flow's prompt tensors are made once a request, in the
    frontend's thread (not the event loop's), every segment's Utterance views them, and the audio is the
    same sample for sample."""
    from engine.serving import kept_prompts

    on_loop = pcm(await collect(engine, req(engine)))
    assert not engine.prompt_in_frontend  # off by default
    threads, make = [], kept_prompts.PromptTensors.of
    monkeypatch.setattr(
        kept_prompts.PromptTensors, "of", lambda *a: threads.append(threading.current_thread()) or make(*a)
    )
    seen, utterance = [], engine.token2wav.utterance
    monkeypatch.setattr(
        engine.token2wav, "utterance", lambda *a, **k: seen.append(utterance(*a, **k)) or seen[-1]
    )
    monkeypatch.setattr(engine, "prompt_in_frontend", True)
    two = " ".join(
        f"This is sentence number {n}, which is long enough to be its own piece." for n in range(8)
    )
    assert len(engine.split_preview(two)) >= 2
    np.testing.assert_array_equal(pcm(await collect(engine, req(engine))), on_loop)
    assert threads and threading.current_thread() not in threads  # this test runs on the event loop
    threads.clear()
    await collect(engine, req(engine, text=two, forced_tokens=20))
    assert len(seen) > 2 and len(threads) == 1  # its segments, one copy
    assert seen[-1].embedding is seen[-2].embedding


async def test_voice_conversion_takes_the_flow_prompt_made_in_the_frontends_thread(
    engine, monkeypatch, tmp_path
):
    """t2w_prompt_in_frontend for voice conversion (its own plan, the prompt untrimmed): the same audio."""
    kw = {"mode": Mode.VC, "text": "", "source_wav": str(write_wav(tmp_path / "src.wav", 2.0, 16000, seed=3))}
    on_loop = pcm(await collect(engine, req(engine, **kw)))
    made, utterance = [], engine.token2wav.utterance
    monkeypatch.setattr(
        engine.token2wav, "utterance", lambda *a, **k: made.append(k["tensors"]) or utterance(*a, **k)
    )
    monkeypatch.setattr(engine, "prompt_in_frontend", True)
    np.testing.assert_array_equal(pcm(await collect(engine, req(engine, **kw))), on_loop)
    assert len(made) == 1 and made[0] is not None


def test_the_engine_holds_its_switch_interval_until_closed(engine):
    """EngineConfig.gil_switch_ms: set as the engine loads, the interpreter's own again once it closes."""
    import sys

    before = sys.getswitchinterval()
    other = TTSEngine.load(replace(engine.cfg, gil_switch_ms=2.0))
    try:
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        other.close()
    assert sys.getswitchinterval() == before


async def test_streaming_and_non_streaming_cover_the_same_tokens(engine):
    # Same seed -> same tokens -> same length. The samples differ where the reference's differ too: its
    # non-final flow calls use chunk-causal attention (test_token2wav checks both against the reference).
    streamed = await collect(engine, req(engine, stream=True))
    whole = await collect(engine, req(engine, stream=False))
    assert pcm(streamed).shape == pcm(whole).shape
    assert len(streamed) > len(whole) == 2  # one audio chunk + the closing chunk


async def test_concurrent_requests_match_the_same_requests_alone(engine):
    reqs = [req(engine, seed=s, text=f"Sentence number {s} for the batch.") for s in range(4)]
    alone = [pcm(await collect(engine, r)) for r in reqs]
    together = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for x, y in zip(alone, together):
        np.testing.assert_allclose(pcm(y), x, atol=1e-4)


async def test_flow_batch_one_runs_every_chunk_alone_with_the_same_audio(engine, monkeypatch):
    """``flow_batch=1`` (the no-batching A/B): each flow call carries one request's chunk; audio unchanged."""
    reqs = [req(engine, seed=s, text=f"Sentence number {s} for the batch.") for s in range(3)]
    batched = await asyncio.gather(*(collect(engine, r) for r in reqs))
    rows, real = [], engine.token2wav._flow
    monkeypatch.setattr(engine.token2wav, "max_batch", 1)
    monkeypatch.setattr(
        engine.token2wav, "_flow", lambda utts, chunks: rows.append(len(utts)) or real(utts, chunks)
    )
    alone = await asyncio.gather(*(collect(engine, r) for r in reqs))
    assert rows and set(rows) == {1}
    for x, y in zip(batched, alone):
        np.testing.assert_allclose(pcm(y), pcm(x), atol=1e-4)


async def test_a_segment_whose_listener_waits_is_urgent_for_the_lm(engine, monkeypatch):
    """The first segment's LM request is URGENT (nothing to play yet); a later one, while the earlier
    segments' audio still plays, is BUFFERED (the LM backends start URGENT requests first)."""
    text = " ".join(
        f"This is sentence number {n}, which is long enough to be its own piece." for n in range(8)
    )
    assert len(engine.split_preview(text)) >= 2
    seen, real = [], engine.backend.generate
    monkeypatch.setattr(engine.backend, "generate", lambda r: seen.append(r.priority) or real(r))
    await collect(engine, req(engine, text=text, forced_tokens=150))  # 6 s of audio per segment
    assert seen[0] == LMRequest.URGENT and len(seen) >= 2
    assert set(seen[1:]) == {LMRequest.BUFFERED}


async def test_closing_a_stream_closes_its_lm_request_at_once(engine, monkeypatch):
    """A caller that leaves after the first chunk ends its LM decode when its stream is closed, not later
    when the garbage collector finalises the generators in between."""
    closed, real = [], engine.backend.generate

    async def generate(r):
        try:
            async for tok in real(r):
                yield tok
        finally:
            closed.append(r.request_id)

    monkeypatch.setattr(engine.backend, "generate", generate)
    stream = engine.stream(req(engine, forced_tokens=300))
    async for _ in stream:
        break
    assert closed == []
    await stream.aclose()
    assert len(closed) == 1  # no await in between: closed down the chain by aclose itself


# ------------------------------------------------ first chunks being decoded (EngineConfig.t2w_quiet_first)


def decoding(engine) -> int:
    return engine.token2wav.scheduler.decoding


def test_quiet_first_is_off_by_default(engine):
    assert not engine.cfg.t2w_quiet_first and not engine.token2wav.scheduler.quiet_first


async def test_a_request_counts_its_first_chunk_as_decoding_until_it_is_queued(engine, monkeypatch):
    """The worker's quiet-first hold counts a request from its first LM segment's start until its first
    chunk is queued: at the first audio it is uncounted; a later segment is never counted."""
    text = " ".join(
        f"This is sentence number {n}, which is long enough to be its own piece." for n in range(4)
    )
    seen, real = [], engine.backend.generate
    monkeypatch.setattr(engine.backend, "generate", lambda r: seen.append(decoding(engine)) or real(r))
    assert decoding(engine) == 0
    at_first = None
    async for _ in engine.stream(req(engine, text=text, forced_tokens=60)):
        at_first = decoding(engine) if at_first is None else at_first
    assert len(seen) >= 2 and seen[0] == 1 and set(seen[1:]) == {0}
    assert at_first == 0 and decoding(engine) == 0
    seen.clear()
    await collect(engine, req(engine, stream=False))  # its first chunk is all of its tokens: not counted
    assert seen == [0] and decoding(engine) == 0


@pytest.mark.parametrize("how", ["abort", "leave", "fail"])
async def test_a_request_that_ends_before_its_first_chunk_uncounts_it(engine, monkeypatch, how):
    """Aborted, left by its client (its task cancelled) or failed while its LM decodes the first chunk: the
    count is back to 0, so the worker's hold can never wait on a request that is gone. With the hold on."""
    real, inside = engine.backend.generate, asyncio.Event()
    r = req(engine, forced_tokens=300)

    async def generate(lm_req):
        async with contextlib.aclosing(real(lm_req)) as tokens:
            async for tok in tokens:
                assert decoding(engine) == 1
                if how == "abort":
                    engine.abort(r.request_id)
                elif how == "fail":
                    raise RuntimeError("the LM failed")
                else:
                    inside.set()
                    await asyncio.Event().wait()  # decoding until the client leaves
                yield tok

    monkeypatch.setattr(engine.backend, "generate", generate)
    scheduler = engine.token2wav.scheduler
    monkeypatch.setattr(scheduler, "quiet_first", True)
    task = asyncio.ensure_future(collect(engine, r))
    if how == "leave":
        await asyncio.wait_for(inside.wait(), WAIT_S)
        task.cancel()
    if how == "abort":
        assert await task == []  # aborted before any audio: no chunk, not even the last
    else:
        with pytest.raises(asyncio.CancelledError if how == "leave" else RuntimeError):
            await task
    assert decoding(engine) == 0
    assert await wait_idle(engine, WAIT_S), idle_state(engine)


def test_graphs_are_precaptured_after_the_lm_backend_starts(tmp_path, monkeypatch):
    """vLLM sizes its KV cache from the device memory free when it starts, so the graphs are captured after
    it (captured first, they left vLLM 24 GiB on the H200), the vocoder's before the flow's. Capture itself
    is recorded, not run."""
    import engine.serving.engine as engine_module
    from engine.flow.graphs import GraphedCFM
    from engine.vocoder.graphs import GraphedHiFT

    events: list[tuple] = []
    real_backend = engine_module._backend
    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)
    monkeypatch.setattr(engine_module, "_backend", lambda *a: events.append(("backend",)) or real_backend(*a))
    for cls, name in ((GraphedCFM, "flow"), (GraphedHiFT, "vocoder")):
        monkeypatch.setattr(
            cls,
            "precapture",
            lambda self, b, t, dev, later=None, name=name: events.append((name, b, t)) or 0,
        )
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    for hift_graphs in (False, True):
        events.clear()
        cfg = EngineConfig(
            model=str(model_dir), device="cpu", backend="native", graph_warmup_s=4.0, flow_batch=4,
            limits=Limits(max_concurrency=8), hift_graphs=hift_graphs,
        )  # fmt: skip
        eng = TTSEngine.load(cfg)
        eng.close()
        assert isinstance(eng.token2wav.hift_graphs, GraphedHiFT) is hift_graphs
        # batch: min(slots, flow_batch); 4 s of mel; the vocoder first (its background graphs then run
        # before the flow's compile)
        assert events == [("backend",)] + [("vocoder", 4, 200)] * hift_graphs + [("flow", 4, 200)]


def test_the_graphed_solvers_page_pool_is_sized_from_the_memory_vllm_left(tmp_path, monkeypatch):
    """v3's CUDA-graph solver gets its page pool at load, before the captures (they record its address):
    by default 40 % of the device memory free then, or ``flow_reuse_gb``; none without reuse."""
    import engine.serving.engine as engine_module
    from engine.flow.dit_pages import PageLayout
    from engine.flow.graphs import GraphedCFM

    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)
    monkeypatch.setattr(engine_module.devices, "free_memory_bytes", lambda dev: 2 * 2**30)
    monkeypatch.setattr(GraphedCFM, "precapture", lambda self, b, t, dev, later=None: 0)
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    pools = []
    for reuse, gb in ((True, None), (True, 0.25), (False, None)):
        cfg = EngineConfig(
            model=str(model_dir), device="cpu", backend="native", hift_graphs=False,
            flow_reuse=reuse, flow_reuse_gb=gb,
        )  # fmt: skip
        eng = TTSEngine.load(cfg)
        eng.close()
        graphed = eng.model.flow.decoder
        assert isinstance(graphed, GraphedCFM) and eng.token2wav.reuses_flow is reuse
        est = graphed.cfm.estimator.cfg
        page = PageLayout.page_bytes(10, est.depth, est.heads, est.dim_head, est.mel_dim, 50)
        pools.append(None if graphed.pool is None else graphed.pool.layout.pages)
    assert pools == [int(0.4 * 2 * 2**30 // page) + 1, int(0.25 * 2**30 // page) + 1, None]


def test_early_first_graphs_are_captured_while_the_lm_starts_with_vllms_share_left(tmp_path, monkeypatch):
    """first_graphs_early: the first graphs are captured while the LM backend is still starting (its start
    here waits for them: the old order would wait for ever), and v3's reuse pool is sized from the memory
    vLLM will leave: 40 % of (free - gpu_memory_utilization x total)."""
    import threading

    import engine.serving.engine as engine_module
    from engine.flow.dit_pages import PageLayout
    from engine.flow.graphs import GraphedCFM
    from engine.lm.native import NativeLM

    captured = threading.Event()

    def precapture(self, b, t, dev, later=None):
        captured.set()
        return 0

    def backend(cfg, files, dev, weights):  # the LM's start, as vLLM's would, outlasting the captures
        assert captured.wait(WAIT_S), "the first graphs waited for the LM backend's start"
        return NativeLM(weights().lm, cfg.sampling)

    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)
    monkeypatch.setattr(engine_module.devices, "free_memory_bytes", lambda dev: 2 * 2**30)
    monkeypatch.setattr(engine_module.devices, "total_memory_bytes", lambda dev: 4 * 2**30)
    monkeypatch.setattr(engine_module, "_uses_vllm", lambda cfg, accelerator: True)
    monkeypatch.setattr(engine_module, "_backend", backend)
    monkeypatch.setattr(GraphedCFM, "precapture", precapture)
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", backend="native", hift_graphs=False, flow_reuse=True,
        first_graphs_early=True, gpu_memory_utilization=0.3, lm_kv_cache_gib=None,
    )  # fmt: skip
    eng = TTSEngine.load(cfg)
    eng.close()
    graphed = eng.model.flow.decoder
    assert isinstance(graphed, GraphedCFM) and graphed.pool is not None and captured.is_set()
    est = graphed.cfm.estimator.cfg
    page = PageLayout.page_bytes(10, est.depth, est.heads, est.dim_head, est.mel_dim, 50)
    assert graphed.pool.layout.pages == int(0.4 * (2 - 0.3 * 4) * 2**30 // page) + 1
    phases = {p.name: p for p in eng.startup.phases}
    weights, first = phases["weights"], phases["first graphs"]
    assert weights.start_s + weights.seconds <= first.start_s <= phases["frontends"].start_s


def _vllm_like_load(tmp_path, monkeypatch, job, backend) -> EngineConfig:
    """A tiny v3's load as beside vLLM's start without a handover: graphs "supported" (the flow's
    precapture queues ``job`` on the builder, capturing nothing), ``backend`` the LM's start."""
    import engine.serving.engine as engine_module
    from engine.flow.graphs import GraphedCFM

    def precapture(self, b, t, dev, later=None):
        later("flow solver graphs", job)
        return 0

    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)
    monkeypatch.setattr(engine_module, "_uses_vllm", lambda cfg, accelerator: True)
    monkeypatch.setattr(engine_module, "_backend", backend)
    monkeypatch.setattr(GraphedCFM, "precapture", precapture)
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    return EngineConfig(model=str(model_dir), device="cpu", backend="native", hift_graphs=False)


def test_without_a_handover_the_graph_builder_runs_while_the_lm_starts(tmp_path, monkeypatch):
    """Where ready waits for vLLM's start anyway (no handover), the builder's jobs (the flow's programs, the
    other graphs) run in that wait, not after ready: the LM's start here waits for a background job. With
    a handover they wait for ready (the first requests run beside them, on the native loop)."""
    import threading

    import engine.serving.engine as engine_module
    from engine.lm.native import NativeLM

    polished = threading.Event()

    def job(stop: threading.Event) -> None:
        polished.set()

    def backend(cfg, files, dev, weights):  # vLLM's start, outlasting the builder's job
        assert polished.wait(WAIT_S), "the builder waited for ready"
        return NativeLM(weights().lm, cfg.sampling)

    cfg = _vllm_like_load(tmp_path, monkeypatch, job, backend)
    eng = TTSEngine.load(cfg)
    try:
        phases = {p.name: p for p in eng.startup.phases}
        assert (
            polished.is_set()
            and phases["flow solver graphs"].start_s
            < phases["LM backend"].start_s + phases["LM backend"].seconds
        )
        assert not eng.graph_builder.wait(0.1)  # begun, not ended: jobs may still come until ready
        eng.graph_builder.start()  # as warmup does at ready
        assert eng.graph_builder.wait(WAIT_S)
    finally:
        eng.close()
    assert engine_module._builds_while_lm_starts(cfg, torch.device("cpu"), handover=True) is False
    late_graphs = replace(cfg, first_graphs_early=False)  # the first graphs after vLLM: nothing early
    assert engine_module._builds_while_lm_starts(late_graphs, torch.device("cpu"), handover=False) is False


def test_a_failed_lm_start_stops_the_builder_begun_beside_it(tmp_path, monkeypatch):
    """No capture outlives a failed load: the builder's running job is told to stop, and the load's error
    reaches the caller."""
    import threading

    running, stopped = threading.Event(), threading.Event()

    def job(stop: threading.Event) -> None:
        running.set()
        if stop.wait(WAIT_S):
            stopped.set()

    def backend(cfg, files, dev, weights):
        assert running.wait(WAIT_S)
        raise RuntimeError("vLLM's engine core died")

    cfg = _vllm_like_load(tmp_path, monkeypatch, job, backend)
    with pytest.raises(RuntimeError, match="engine core died"):
        TTSEngine.load(cfg)
    assert stopped.is_set()


def test_by_default_the_first_graphs_come_early_only_beside_a_vllm_start(monkeypatch) -> None:
    """Auto: early where vLLM starts with a fixed KV cache (no memory profiling to race); never beside the
    native LM, whose start is instant; off where vLLM sizes its cache by profiling, unless forced."""
    import engine.serving.engine as engine_module

    cpu = torch.device("cpu")
    assert engine_module._graphs_early(EngineConfig(), cpu) is False  # the native LM on a CPU
    monkeypatch.setattr(engine_module, "_uses_vllm", lambda cfg, accelerator: True)
    assert engine_module._graphs_early(EngineConfig(), cpu) is True
    assert engine_module._graphs_early(EngineConfig(lm_kv_cache_gib=None), cpu) is False
    assert engine_module._graphs_early(EngineConfig(lm_kv_cache_gib=None, first_graphs_early=True), cpu)
    assert engine_module._graphs_early(EngineConfig(first_graphs_early=False), cpu) is False
    assert engine_module._graphs_early(EngineConfig(background_graphs=False), cpu) is False


def test_the_share_vllm_will_take_is_its_memory_share_or_a_fixed_kv_cache_and_what_it_holds_beside(
    monkeypatch,
):
    import engine.serving.engine as engine_module

    monkeypatch.setattr(engine_module.devices, "total_memory_bytes", lambda dev: 100 * 2**30)
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_module, "_uses_vllm", lambda cfg, accelerator: True)
    assert engine_module._lm_share(EngineConfig(gpu_memory_utilization=0.3, lm_kv_cache_gib=None), cpu) == 0.3
    share = engine_module._lm_share(EngineConfig(lm_kv_cache_gib=6.0), cpu)
    assert share == pytest.approx((6.0 + engine_module.LM_BESIDE_KV_GIB) / 100)
    monkeypatch.setattr(engine_module, "_uses_vllm", lambda cfg, accelerator: False)
    assert engine_module._lm_share(EngineConfig(lm_kv_cache_gib=6.0), cpu) == 0.0  # no vLLM: nothing taken


def test_v2s_graphed_solver_reuses_frames_only_when_asked(tmp_path, monkeypatch):
    """flow_reuse auto: v2's CUDA-graph solver gets no page pool and recomputes (its windows measured slower
    on the H200); --flow-reuse gives it one; v2's eager solver reuses in auto."""
    import engine.serving.engine as engine_module
    from engine.flow.graphs import GraphedCFM

    monkeypatch.setattr(engine_module.devices, "free_memory_bytes", lambda dev: 2**30)
    monkeypatch.setattr(GraphedCFM, "precapture", lambda self, b, t, dev, later=None: 0)
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice2", "tiny")
    seen = []
    for graphs, reuse in ((True, None), (True, True), (False, None)):
        monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev, graphs=graphs: graphs)
        cfg = EngineConfig(model=str(model_dir), device="cpu", backend="native", flow_reuse=reuse)
        eng = TTSEngine.load(cfg)
        eng.close()
        solver = eng.model.flow.decoder
        pool = getattr(solver, "pool", None)
        seen.append((isinstance(solver, GraphedCFM), pool is not None, eng.token2wav.reuses_flow))
    assert seen == [(True, False, False), (True, True, True), (False, False, True)]


def test_the_graphed_solver_compiles_v3s_estimator_and_not_v2s_by_default(tmp_path, monkeypatch):
    """flow_compile auto: v3's DiT through Inductor (its kernels in cache_dir/compile), v2's U-Net eager
    in its graphs (its compiled cold start ran past 460 s on the H200); an explicit choice holds for both."""
    import engine.serving.engine as engine_module
    from engine.flow.graphs import GraphedCFM

    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)
    monkeypatch.setattr(GraphedCFM, "precapture", lambda self, b, t, dev, later=None: 0)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    compiled = {}
    for family, choice in (("cosyvoice2", None), ("cosyvoice3", None), ("cosyvoice2", True)):
        model_dir = build_model_dir(tmp_path / family, family, "tiny")
        cfg = EngineConfig(
            model=str(model_dir), device="cpu", backend="native", hift_graphs=False, flow_reuse=False,
            flow_compile=choice, cache_dir=str(tmp_path / "cache"),
        )  # fmt: skip
        eng = TTSEngine.load(cfg)
        eng.close()
        estimator = eng.model.flow.decoder.solver.estimator
        compiled[family, choice] = estimator.compiled and estimator.run != estimator.inner.__call__
    assert compiled == {("cosyvoice2", None): False, ("cosyvoice3", None): True, ("cosyvoice2", True): True}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "compile" / "inductor")


def test_the_config_sets_the_flow_batch_and_the_prompt_cache(tmp_path):
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", backend="native", flow_batch=3, prompt_cache_size=0,
        t2w_own_stream=False, t2w_quiet_first=True,
    )  # fmt: skip
    eng = TTSEngine.load(cfg)
    try:
        assert (eng.token2wav.max_batch, eng.token2wav.own_stream) == (3, False)  # on by default
        assert eng.token2wav.scheduler.quiet_first  # off unless asked for (the module's engine)
        eng.frontend.extract(speech_like(3.0, 24000))
        assert eng.frontend.cache_info() == (0, 0)  # recomputed for every request
    finally:
        eng.close()


async def test_folded_attention_serves_the_same_audio(engine, tmp_path):
    """flow_attention "folded" (the attention rules in q/k dims, no mask tensor): the same request gets the
    same audio as with the dense masks."""
    cfg = replace(engine.cfg, flow_attention="folded", voices_dir=str(tmp_path / "voices"))
    folded = TTSEngine.load(cfg)
    folded.ready = True
    try:
        assert folded.model.flow.decoder.estimator.fold_masks
        assert not engine.model.flow.decoder.estimator.fold_masks
        got, want = pcm(await collect(folded, req(engine))), pcm(await collect(engine, req(engine)))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    finally:
        folded.close()


def test_cudnn_attention_is_held_while_the_engine_is_open_and_undone_on_close_or_a_failed_load(
    engine, tmp_path, monkeypatch
):
    """flow_attention "cudnn": the engine enters the kernel order before its flow loads (a CPU machine
    has no cuDNN: a recording context stands in) and leaves it on close, or at once when loading fails."""
    held: list[str] = []

    @contextlib.contextmanager
    def order(dev):
        held.append(f"in:{dev.type}")
        try:
            yield
        finally:
            held.append("out")

    monkeypatch.setattr("engine.serving.engine.devices.cudnn_attention", order)
    cfg = replace(engine.cfg, flow_attention="cudnn", voices_dir=str(tmp_path / "voices"))
    eng = TTSEngine.load(cfg)
    assert held == ["in:cpu"]
    eng.close()
    assert held == ["in:cpu", "out"]

    def broken(files, dev, cache, onto):
        raise RuntimeError("flow.pt is damaged")

    monkeypatch.setattr("engine.serving.engine.load_model", broken)
    with pytest.raises(RuntimeError, match="damaged"):
        TTSEngine.load(cfg)
    assert held == ["in:cpu", "out", "in:cpu", "out"]


def test_cudnn_attention_on_a_cpu_engine_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TTSEngine.load(replace(engine.cfg, flow_attention="cudnn"))


async def test_abort_mid_stream_frees_everything(engine):
    r = req(engine, text=" ".join([TEXT] * 4))
    got, held = [], []
    async for chunk in engine.stream(r):
        got.append(chunk)
        held.append(engine.token2wav.reuse_budget.held)  # the stream's flow frames are cached (v2 and v3)
        assert engine.abort(r.request_id)
    assert not got[-1].is_last
    assert held[0] > 0
    assert await wait_idle(engine, WAIT_S), idle_state(engine)  # the LM and worker threads let go
    assert engine.admission.active == 0 and engine.backend.active == 0 and engine.token2wav.pending == 0
    assert engine.token2wav.scheduler.decoding == 0  # no first chunk left counted as being decoded
    assert not engine.abort(r.request_id)  # nothing left to abort
    assert await flow_frames_freed(engine), engine.token2wav.reuse_budget.held


async def test_closing_the_stream_frees_everything(engine):
    gen = engine.stream(req(engine, text=" ".join([TEXT] * 4)))
    await gen.__anext__()
    await gen.aclose()
    assert await wait_idle(engine, WAIT_S), idle_state(engine)
    assert engine.admission.active == 0 and engine.backend.active == 0 and decoding(engine) == 0
    assert await flow_frames_freed(engine), engine.token2wav.reuse_budget.held


async def flow_frames_freed(engine) -> bool:
    """True once no flow cache holds frames: the worker may still be running the closed stream's chunk
    (its batch holds the Utterance, and with it the cache, until the call returns; seconds on a busy
    machine), then the collector frees the Utterance."""
    deadline = time.monotonic() + WAIT_S
    while gc.collect() >= 0 and engine.token2wav.reuse_budget.held:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_finished_stream_leaves_no_flow_cache_behind(engine):
    """The final flow call releases the stream's cached frames at once, without waiting for the GC."""
    await collect(engine, req(engine))
    assert engine.token2wav.reuse_budget.held == 0


def write_raw(path: Path, samples: np.ndarray, sr: int) -> str:
    import soundfile as sf

    sf.write(path, samples, sr)
    return str(path)


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("silent", InvalidInput, "silent"),
        ("too_long", TooLarge, "30"),
        ("corrupt", InvalidInput, "audio"),
        ("8khz", InvalidInput, "16"),
        ("empty_text", InvalidInput, "empty"),
        ("huge_text", TooLarge, "characters"),
    ],
)
async def test_bad_inputs_get_clear_errors(engine, tmp_path, case, error, message):
    kw: dict = {}
    if case == "silent":
        kw["prompt_wav"] = write_raw(tmp_path / "s.wav", np.zeros(48000, np.float32), 16000)
    elif case == "too_long":
        kw["prompt_wav"] = write_raw(tmp_path / "l.wav", speech_like(31, 16000), 16000)
    elif case == "corrupt":
        (tmp_path / "c.wav").write_bytes(b"RIFF\x00\x00garbage" * 10)
        kw["prompt_wav"] = str(tmp_path / "c.wav")
    elif case == "8khz":
        kw["prompt_wav"] = write_raw(tmp_path / "n.wav", speech_like(3, 8000), 8000)
    elif case == "empty_text":
        kw["text"] = "   "
    else:
        kw["text"] = "x" * 5000
    with pytest.raises(error, match=message):
        await collect(engine, req(engine, **kw))
    assert engine.admission.active == 0
    assert pcm(await collect(engine, req(engine))).size > 0  # still serving


def test_split_preview_shows_the_normalised_segments(engine):
    segments = engine.split_preview("I have 2 apples. " * 30, "en")
    assert len(segments) > 1 and all("two" in s for s in segments) and "2" not in "".join(segments)
    assert engine.split_preview("   ") == []


async def test_fast_start_auto_gives_a_lone_request_an_earlier_first_chunk(engine, monkeypatch, tmp_path):
    """auto: a request alone on the engine gets the split first chunk, v3's and v2's."""
    seen = []
    real = engine.token2wav.utterance

    def spy(*args, **kw):
        utt = real(*args, **kw)
        seen.append(utt.planner.this_hop)
        return utt

    monkeypatch.setattr(engine.token2wav, "utterance", spy)
    auto = replace(engine.cfg.stream, fast_start=None)
    monkeypatch.setattr(engine, "cfg", replace(engine.cfg, stream=auto))
    prompt = write_wav(tmp_path / "p.wav", 3.5)  # ~87 prompt tokens: pad 12-13 to the 25-token grid
    await engine.synthesize(req(engine, stream=True, prompt_wav=str(prompt)))
    pad = seen[0] % 25
    assert engine.cfg.stream.fast_start is None and pad >= 12
    assert seen[0] == pad


async def test_fast_start_burst_rule_splits_by_the_starts_the_engine_counted(engine, monkeypatch):
    """With fast_start_burst_s the engine counts its recent slot takings: a request alone gets the split
    (v3's and v2's), one that starts right after a burst of others does not, whatever the active count.
    What the rule read is noted for the request's trace (requests computing, recent starts, its own
    included), with the parts of its first token's wait."""
    from engine.serving.admission import Admission
    from engine.serving.metrics import Stopwatch

    burst = replace(engine.cfg.stream, fast_start=None, fast_start_burst_s=30.0)
    monkeypatch.setattr(engine, "cfg", replace(engine.cfg, stream=burst))
    monkeypatch.setattr(engine, "admission", Admission(max_active=4, max_queue=4))  # no earlier starts
    watch = Stopwatch("r", 0)
    assert engine._splits_first_chunk(watch)
    assert watch.load == (0, 0)
    most = engine.cfg.stream.fast_start_max_active
    for _ in range(most + 1):
        engine.admission.started(time.perf_counter())
    assert not engine._splits_first_chunk(watch)  # a burst of starts: the reference's first chunk
    assert watch.load == (0, most + 1)
    chunks = await collect(engine, req(engine))  # the request's own start is counted too
    assert engine.admission.started_within(30.0, time.perf_counter()) == most + 2
    traces = [c.trace for c in chunks if c.trace is not None]
    assert traces and {(t.computing_at_start, t.recent_starts) for t in traces} == {(1, most + 2)}
    # the first token's wait in parts: the frontend, the flow's prompt, the LM's prompt embeddings, the token
    first = traces[0]
    parts = (first.frontend_ms, first.flow_prompt_ms, first.prefix_ms, first.lm_first_token_ms)
    assert None not in parts
    assert 0 < parts[0] <= parts[1] <= parts[2] <= parts[3] <= first.ready_ms  # type: ignore[operator]


def test_the_worker_hears_of_a_stream_short_of_audio_from_the_engines_own_streams(engine, monkeypatch):
    """auto's signal for the relaxed rule: a stream before its first audio, or with under relaxed_slack_s
    buffered, is thin; one with more buffered, or with all of its audio delivered, is not; the worker
    built by the engine asks the engine."""
    from engine.serving.engine import _Active

    assert engine.cfg.t2w_relaxed_cap is None and engine.token2wav.scheduler.relaxed_cap is None
    assert engine.token2wav.scheduler.thin == engine._thin_stream
    monkeypatch.setattr(engine, "_active", set())
    assert not engine._thin_stream()  # nobody to wait
    waiting, playing, done = _Active("waiting"), _Active("playing"), _Active("done")
    engine._active.add(waiting)
    assert engine._thin_stream()  # its first chunk is still to come
    waiting.playback.delivered(engine.cfg.stream.relaxed_slack_s + 5.0)
    playing.playback.delivered(engine.cfg.stream.relaxed_slack_s + 5.0)
    done.playback.finished = True
    engine._active |= {playing, done}
    assert not engine._thin_stream()
    playing.playback.runs_out_at = time.perf_counter() + 0.5  # played down to half a second
    assert engine._thin_stream()


async def test_final_metrics_split_the_ttfa_into_its_parts(engine):
    chunks = await collect(engine, req(engine, stream=True))
    m = chunks[-1].metrics
    assert list(m.ttfa_parts_ms) == ["queue", "frontend", "lm", "t2w_wait", "t2w_compute"]
    assert all(v >= 0 for v in m.ttfa_parts_ms.values())
    assert sum(m.ttfa_parts_ms.values()) == pytest.approx(m.ttfa_ms, abs=1e-6)
    assert m.ttfa_parts_ms["t2w_compute"] > 0 and m.ttfa_parts_ms["lm"] > 0


async def test_a_stopped_backend_refuses_requests_clearly_and_reports_unhealthy(engine, monkeypatch):
    assert engine.healthy
    monkeypatch.setattr(type(engine.backend), "healthy", property(lambda self: False))
    assert not engine.healthy
    with pytest.raises(NotReady, match="restart"):
        await collect(engine, req(engine))
    monkeypatch.undo()
    assert engine.healthy and len(pcm(await collect(engine, req(engine)))) > 0  # serving again


@pytest.mark.parametrize(
    ("device", "share", "message"),
    [("cuda", 60, "torch sees no CUDA"), ("auto", None, "needs a CUDA device")],
)
def test_a_load_that_fails_after_starting_mps_tells_its_daemon_to_quit(
    device, share, message, monkeypatch, tmp_path
):
    """--cuda-mps on a machine without CUDA: the daemon (a stand-in) starts before the device is resolved,
    and the failed load tells it to quit, leaving no MPS variables behind."""
    import tempfile

    from engine import device as devices
    from engine.cache_root import COMPILE_DIRS
    from tests.fakes import fake_mps_control

    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without CUDA")
    fake_mps_control(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for name in (
        *COMPILE_DIRS,
        devices.MPS_PIPE,
        devices.MPS_LOG,
        devices.MPS_THREADS,
    ):  # the load sets these
        monkeypatch.setenv(name, os.environ.get(name, ""))
        monkeypatch.delenv(name)
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice2", "tiny")
    with tempfile.TemporaryDirectory(prefix="mps") as root:  # short: the pipe directory holds sockets
        cfg = EngineConfig(
            model=str(model_dir), device=device, backend="native", cache_dir=root, cuda_mps=True,
            mps_flow_percent=share,
        )  # fmt: skip
        with pytest.raises(RuntimeError, match=message):
            TTSEngine.load(cfg)
        control, log = Path(root) / "mps" / "pipe" / "control", Path(root) / "mps" / "log" / "calls.log"
        assert log.read_text().split()[0] == "-d"  # it did start
        deadline = time.monotonic() + WAIT_S
        while control.exists() and time.monotonic() < deadline:  # the stopper's quit, from its own process
            time.sleep(0.05)
        assert not control.exists() and log.read_text().split()[-1] == "quit"
    assert not {devices.MPS_PIPE, devices.MPS_LOG, devices.MPS_THREADS} & set(os.environ)


def test_the_vllm_backend_gets_the_lm_settings_from_the_config(tmp_path, monkeypatch):
    """vLLM is not installed here: its backend module is a stand-in that keeps what the engine passes."""
    import sys
    import types

    import engine.serving.engine as engine_module

    made: list[dict[str, object]] = []

    class Backend:
        def __init__(self, export, sampling, utilization, **kwargs):
            made.append({"export": export, "utilization": utilization, **kwargs})

    stub = types.ModuleType("engine.lm.vllm_backend")
    stub.VLLMBackend = Backend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engine.lm.vllm_backend", stub)
    monkeypatch.setattr(engine_module, "_uses_vllm", lambda cfg, accelerator: True)
    monkeypatch.setattr(engine_module, "_hf_export", lambda cfg, files: tmp_path / "export")
    weights = types.SimpleNamespace(lm="the loaded LM")
    cfg = EngineConfig(
        model="demo-tiny", device="cpu", lm_profile_dir=str(tmp_path / "lm"), lm_ras_graphs=False,
        lm_kv_cache_gib=6.0,
    )  # fmt: skip
    backend = engine_module._backend(cfg, None, torch.device("cpu"), lambda: weights)  # type: ignore[arg-type]
    settings = {"profile_dir": str(tmp_path / "lm"), "ras_graphs": False, "kv_cache_gib": 6.0}
    assert made == [{"export": tmp_path / "export", "utilization": 0.3, **settings}]
    assert backend.lm == "the loaded LM"


def test_with_lm_host_vllm_is_started_in_a_host_process_with_the_same_settings(tmp_path, monkeypatch):
    """``lm_host``: the engine starts ``engine.lm.lm_host.HostedLM`` (kept here) and never imports the
    in-process backend's module."""
    import sys
    import types

    import engine.lm.lm_host as lm_host
    import engine.serving.engine as engine_module

    made: list[lm_host.HostSpec] = []

    class Hosted:
        def __init__(self, spec):
            made.append(spec)

    monkeypatch.setattr(lm_host, "HostedLM", Hosted)
    monkeypatch.setitem(sys.modules, "engine.lm.vllm_backend", None)  # an import of it would fail
    monkeypatch.setattr(engine_module, "_uses_vllm", lambda cfg, accelerator: True)
    monkeypatch.setattr(engine_module, "_hf_export", lambda cfg, files: tmp_path / "export")
    weights = types.SimpleNamespace(lm="the loaded LM")
    cfg = EngineConfig(
        model="demo-tiny", device="cpu", lm_host=True, lm_ras_graphs=False, lm_kv_cache_gib=6.0
    )
    backend = engine_module._backend(cfg, None, torch.device("cpu"), lambda: weights)  # type: ignore[arg-type]
    assert made == [
        lm_host.HostSpec(tmp_path / "export", cfg.sampling, 0.3, None, ras_graphs=False, kv_cache_gib=6.0)
    ]
    assert isinstance(backend, Hosted) and backend.lm == "the loaded LM"  # type: ignore[attr-defined]


def vllm_stand_in(before):
    """vLLM's start as the engine's ``_backend``: ``before()`` (a wait, a note), then a second native loop
    named vllm (the same sampling)."""
    from engine.lm.native import NativeLM

    def start(cfg, files, dev, weights):
        before()
        second = NativeLM(weights().lm, cfg.sampling)
        second.name = "vllm"  # type: ignore[misc]
        return second

    return start


def vllm_cfg(tmp_path, **settings) -> EngineConfig:
    """The tiny v2 model on the CPU with vLLM asked for (its start stood in for)."""
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice2", "tiny")
    voices = str(tmp_path / "v")
    return EngineConfig(model=str(model_dir), device="cpu", backend="vllm", voices_dir=voices, **settings)


async def test_the_engine_serves_on_the_native_loop_while_vllm_starts_then_hands_over(tmp_path, monkeypatch):
    """With vLLM and a handover (the default where its KV cache has a fixed size) the engine is ready as
    soon as the native loop can serve; /ready's stage is "warming" until vLLM (here a second native loop
    that starts when the test lets it) takes new requests and the first loop is retired. The same request
    gives the same audio before and after: the sampling is the same on both."""
    import threading

    import engine.serving.engine as module

    up = threading.Event()
    # vLLM's start (tens of seconds on a GPU) until the test lets it
    monkeypatch.setattr(module, "_backend", vllm_stand_in(lambda: up.wait(WAIT_S)))
    cfg = vllm_cfg(tmp_path)  # lm_handover auto: on with vLLM and its fixed KV cache
    idle: list[bool] = []  # the caller's work beside vLLM's start (the studio import) still runs before ready
    eng = TTSEngine.load(cfg, idle_work=(("studio import", lambda: idle.append(up.is_set())),))
    try:
        assert idle == [False] and [p.name for p in eng.startup.phases].count("studio import") == 1
        await eng.warmup()
        assert eng.ready and eng.lm_backend == "native" and eng.startup.stage() == "warming"
        eng.prompt = write_wav(tmp_path / "prompt.wav", 3.0)
        before = pcm(await collect(eng, req(eng)))
        up.set()
        assert await asyncio.to_thread(eng.backend.wait_settled, WAIT_S)
        assert eng.lm_backend == "vllm" and eng.startup.stage() == "steady" and eng.healthy
        after = pcm(await collect(eng, req(eng)))
        assert before.size > 0
        np.testing.assert_array_equal(before, after)
    finally:
        up.set()
        eng.close()


async def test_with_lm_start_after_ready_vllm_starts_only_once_the_engine_is_ready(tmp_path, monkeypatch):
    """lm_start_after_ready: nothing of vLLM's start (here a stand-in that notes when it is called) runs
    during the load or the warm-up; it begins once warmup has marked the engine ready, its phase on the
    timeline after ready, and the handover then happens as without the gate."""
    import engine.serving.engine as module

    called: list[float | None] = []  # the timeline's ready instant when vLLM's start began
    monkeypatch.setattr(module, "_backend", vllm_stand_in(lambda: called.append(eng.startup.ready_s)))
    eng = TTSEngine.load(vllm_cfg(tmp_path, lm_start_after_ready=True))
    try:
        assert called == [] and eng.lm_backend == "native"  # loaded, not started
        await eng.warmup()
        assert await asyncio.to_thread(eng.backend.wait_settled, WAIT_S)
        ready = eng.startup.ready_s
        assert ready is not None and called == [ready]  # once, and after ready
        phases = {p.name: p for p in eng.startup.phases}
        assert phases["LM backend"].start_s >= ready
        assert eng.lm_backend == "vllm" and eng.startup.stage() == "steady"
    finally:
        eng.close()


def test_an_engine_closed_before_ready_never_starts_its_held_lm(tmp_path, monkeypatch, caplog):
    """lm_start_after_ready, closed before any warm-up (a server stopping during its start): the held start
    ends without calling vLLM, its thread ends, and nothing is logged as a failed start."""
    import engine.serving.engine as module

    called: list[bool] = []
    monkeypatch.setattr(module, "_backend", lambda *a: called.append(True))
    eng = TTSEngine.load(vllm_cfg(tmp_path, lm_start_after_ready=True))
    eng.close()
    assert eng.backend.wait_settled(WAIT_S)
    assert called == [] and "failed to start" not in caplog.text


def test_lm_start_after_ready_needs_the_handover():
    assert EngineConfig(lm_start_after_ready=True).lm_start_after_ready
    with pytest.raises(ValueError, match="lm_start_after_ready needs the LM handover"):
        EngineConfig(lm_start_after_ready=True, lm_handover=False)
    with pytest.raises(ValueError, match="lm_start_after_ready must be True or False"):
        EngineConfig(lm_start_after_ready="yes")  # type: ignore[arg-type]


def test_the_handover_is_asked_for_and_needs_vllm_with_a_fixed_kv_cache():
    assert EngineConfig().hands_over  # auto: on where vLLM's KV cache has a fixed size (the default)
    assert not EngineConfig(lm_kv_cache_gib=None).hands_over  # a profiling vLLM: no native loop beside it
    assert not EngineConfig(backend="native").hands_over and not EngineConfig(lm_handover=False).hands_over
    assert EngineConfig(lm_handover=True).hands_over
    for bad in (dict(lm_handover=True, backend="native"), dict(lm_handover=True, lm_kv_cache_gib=None)):
        with pytest.raises(ValueError, match="lm_handover"):
            EngineConfig(**bad)


async def test_the_first_chunk_lane_opens_at_load_and_serves_the_same_audio(engine, tmp_path, monkeypatch):
    """t2w_first_lane on the CPU (no graphs): the lane opens with the engine, and a streaming request's first
    chunk, queued by the engine as it queues any (its playback deadline), is the lane's to take: with the
    main worker kept from taking anything, the first audio still comes, from the lane; the later chunks
    from the main worker once it takes again. The audio is the one-worker engine's."""
    gate, take = threading.Event(), ChunkScheduler.next_batch

    def gated(self):  # the main worker's take, held until the first audio is out
        assert gate.wait(WAIT_S)
        return take(self)

    monkeypatch.setattr(ChunkScheduler, "next_batch", gated)
    cfg = replace(engine.cfg, t2w_first_lane=True, voices_dir=str(tmp_path / "voices"))
    laned = TTSEngine.load(cfg)
    laned.ready = True
    try:
        assert laned.token2wav.first_lane and not engine.token2wav.first_lane
        stream = laned.stream(req(engine))
        first = await asyncio.wait_for(anext(stream), WAIT_S)
        gate.set()
        got = [first, *[c async for c in stream]]
        assert first.trace is not None and first.trace.lane == FIRST_LANE
        assert {c.trace.lane for c in got[1:] if c.trace is not None} == {"main"}
        gate.set()  # the one-worker engine's take is patched too
        want = await collect(engine, req(engine))
        np.testing.assert_allclose(pcm(got), pcm(want), atol=1e-4, rtol=0)
        assert laned.token2wav.healthy
    finally:
        gate.set()
        laned.close()


@pytest.mark.parametrize("lane", [None, True, False])
def test_with_background_graphs_the_first_lane_opens_as_the_builders_last_job(tmp_path, monkeypatch, lane):
    """Where the flow is graphed, the lane's graphs are captured (and it opens) after every other graph
    job: of the solver serving by then; by default too (auto: where the device replays graphs), not when
    turned off. Capture itself is recorded, not run."""
    import engine.serving.engine as engine_module
    from engine.flow.graphs import GraphedCFM

    opened: list[int] = []
    monkeypatch.setattr(engine_module.devices, "graphs_supported", lambda dev: True)

    def precapture(self, batch, frames, dev, later=None):
        later("flow", lambda stop: None)  # the other graphs' jobs, queued before the lane's

    monkeypatch.setattr(GraphedCFM, "precapture", precapture)
    monkeypatch.setattr(engine_module, "open_lane", lambda t2w, flow, hift, n, *_: opened.append(n))
    model_dir = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", backend="native", graph_warmup_s=4.0, hift_graphs=False,
        t2w_first_lane=lane,
    )  # fmt: skip
    eng = TTSEngine.load(cfg)
    try:
        jobs = ["flow", "first-chunk lane graphs"] if lane is not False else ["flow"]
        assert [name for name, _ in eng.graph_builder._jobs] == jobs
        assert opened == []  # not before the builder runs
        eng.graph_builder.start()
        assert eng.graph_builder.wait(WAIT_S) and opened == ([200] if lane is not False else [])  # 4 s of mel
    finally:
        eng.close()


@pytest.mark.parametrize(
    "asked, backend, started",
    [(True, "vllm", True), (True, "auto", False), (True, "native", False), (False, "vllm", False)],
)
def test_the_fork_server_starts_only_where_asked_for_and_vllm_serves(monkeypatch, asked, backend, started):
    """``lm_fork_server`` starts the process vLLM's engine core forks from, where vLLM serves the LM
    (asked for; auto on the CPU is the native loop): never for a native loop, which has no engine core."""
    from engine.serving import engine as engine_module

    calls: list[tuple] = []
    monkeypatch.setattr(engine_module.fork_server, "start", lambda *modules: calls.append(modules))
    cfg = EngineConfig(backend=backend, lm_fork_server=asked)
    engine_module._start_fork_server(cfg, torch.device("cpu"))
    assert calls == ([()] if started else [])


def test_single_stream_graphs_at_load_captures_every_lone_bucket_before_ready(tmp_path, monkeypatch):
    """EngineConfig.single_stream_graphs_at_load: the load's first graphs hold every batch-1 bucket of the
    vocoder (the tiny v3's, capture emulated on the CPU), not only the widest; the background job keeps the
    rest. Off (the default): batch 1's widest alone, the others left to the builder."""
    from types import SimpleNamespace

    from engine.checkpoint import load_model
    from engine.hub import validate_model_dir
    from engine.serving import engine as engine_module
    from engine.vocoder.graphs import GraphedHiFT
    from tests.engine.test_graph_cache import emulate_capture

    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    cpu = torch.device("cpu")
    hift = load_model(validate_model_dir(build_model_dir(tmp_path, "cosyvoice3", "tiny")), cpu).hift
    lone: dict[bool, list] = {}
    for on in (False, True):
        graphed = GraphedHiFT(hift, frame_bucket=100, max_frames=400)
        # 8 s of mel: buckets of up to 400 frames
        cfg = EngineConfig(model="demo-tiny", graph_warmup_s=8.0, single_stream_graphs_at_load=on)
        jobs: list[str] = []
        builder = SimpleNamespace(add=lambda name, job, jobs=jobs: jobs.append(name))
        with torch.inference_mode():
            engine_module._precapture(None, graphed, cfg, cpu, builder)  # type: ignore[arg-type]
        lone[on] = sorted(k for k in graphed.graphs.keys() if k[0] == 1)  # noqa: SIM118 (not a dict)
        assert jobs == ["vocoder graphs"]
    assert lone == {False: [(1, 400)], True: [(1, 100), (1, 200), (1, 300), (1, 400)]}
    with pytest.raises(ValueError, match="single_stream_graphs_at_load"):
        EngineConfig(single_stream_graphs_at_load="yes")  # type: ignore[arg-type]
