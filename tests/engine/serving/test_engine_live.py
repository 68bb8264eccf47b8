"""TTSEngine with text-streaming input (bistream) on tiny random-weight model directories (native, CPU)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engine.config import Limits
from engine.demo.make_model import build_model_dir
from engine.errors import InvalidInput, SynthesisFailed, TooLarge
from engine.request import Mode, SynthesisRequest
from tests.reliability.support import load_engine
from tests.sounds import write_wav

WORDS = ["Hello", "there,", "this", "is", "a", "short", "test", "sentence"]
WORDS += ["that", "arrives", "word", "by", "word."]


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = build_model_dir(root / "model", request.param, "tiny")
    limits = Limits(max_concurrency=4, max_queue=8, max_text_chars=400, text_idle_s=2)
    eng = load_engine(model_dir, root / "voices", limits)
    eng.prompt = write_wav(root / "prompt.wav", 3.0)
    yield eng
    eng.close()


async def words(items: list[str], delay_s: float = 0.0) -> AsyncIterator[str]:
    for i, word in enumerate(items):
        if delay_s:
            await asyncio.sleep(delay_s)
        yield word if i == 0 else " " + word


def live(engine, pieces: AsyncIterator[str], **kw) -> SynthesisRequest:
    base = dict(prompt_wav=str(engine.prompt), prompt_text="A prompt transcript.", seed=1, forced_tokens=60)
    return SynthesisRequest(**(base | kw), text_stream=pieces)


@pytest.mark.parametrize("mode", [Mode.ZERO_SHOT, Mode.CROSS_LINGUAL], ids=["zero_shot", "cross_lingual"])
async def test_streamed_text_comes_out_as_streamed_audio(engine, mode):
    chunks = [c async for c in engine.stream(live(engine, words(WORDS), mode=mode))]
    assert chunks[-1].is_last and len(chunks) >= 3  # several audio chunks, then the closing one
    audio = np.concatenate([c.pcm for c in chunks])
    assert audio.size > 0 and np.isfinite(audio).all()
    final = chunks[-1].metrics
    assert final.done and final.lm_tokens >= 60 and final.ttfa_ms is not None


async def test_streamed_text_takes_the_flow_prompt_made_in_the_frontends_thread(engine, monkeypatch):
    """EngineConfig.t2w_prompt_in_frontend: a text-streaming request's flow prompt comes with its plan (made
    off the event loop) and its audio is the same as with the prompt copied on the loop."""
    on_loop = [c async for c in engine.stream(live(engine, words(WORDS)))]
    made, utterance = [], engine.token2wav.utterance
    monkeypatch.setattr(
        engine.token2wav, "utterance", lambda *a, **k: made.append(k["tensors"]) or utterance(*a, **k)
    )
    monkeypatch.setattr(engine, "prompt_in_frontend", True)
    off_loop = [c async for c in engine.stream(live(engine, words(WORDS)))]
    assert len(made) == 1 and made[0] is not None
    np.testing.assert_array_equal(
        np.concatenate([c.pcm for c in off_loop]), np.concatenate([c.pcm for c in on_loop])
    )


async def test_first_audio_comes_before_the_text_ends(engine):
    """Audio must start while text is still arriving: the text ends only after the first chunk is out."""
    first_audio = asyncio.Event()
    ended_after_audio: list[bool] = []

    async def slow() -> AsyncIterator[str]:
        for i, word in enumerate(WORDS):
            yield word if i == 0 else " " + word
            if i >= 9:  # enough text for the first chunk (no prompt speech); wait for it before the rest
                await asyncio.wait_for(first_audio.wait(), 60)
        ended_after_audio.append(first_audio.is_set())

    async for chunk in engine.stream(live(engine, slow(), mode=Mode.CROSS_LINGUAL)):
        if chunk.pcm.size:
            first_audio.set()
    assert ended_after_audio == [True]


async def test_ttfa_counts_from_the_first_piece(engine):
    async def late() -> AsyncIterator[str]:
        await asyncio.sleep(1.0)  # the request waits for text: not part of the time to first audio
        async for w in words(WORDS):
            yield w

    chunks = [c async for c in engine.stream(live(engine, late()))]
    m = chunks[-1].metrics
    assert m.ttfa_ms is not None and m.ttfa_ms < m.elapsed_ms - 900


async def test_same_seed_same_audio(engine):
    a = [c.pcm async for c in engine.stream(live(engine, words(WORDS)))]
    b = [c.pcm async for c in engine.stream(live(engine, words(WORDS, 0.01)))]  # other piece timing
    np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b))


async def test_empty_text_is_refused(engine):
    with pytest.raises(InvalidInput, match="empty"):
        async for _ in engine.stream(live(engine, words(["", " "]))):
            pass


async def test_too_much_text_is_refused_and_the_engine_keeps_serving(engine):
    with pytest.raises(TooLarge, match="400 characters"):
        async for _ in engine.stream(live(engine, words(["word"] * 10 + ["x" * 400]))):
            pass
    chunks = [c async for c in engine.stream(live(engine, words(WORDS)))]
    assert chunks[-1].is_last


async def test_a_stalled_text_stream_times_out(engine):
    async def stalled() -> AsyncIterator[str]:
        yield "Hello"
        await asyncio.sleep(60)
        yield " never"

    with pytest.raises(SynthesisFailed, match="no text arrived"):
        async for _ in engine.stream(live(engine, stalled())):
            pass
    assert engine.stats().active_streams == 0


async def test_abort_stops_a_live_request(engine):
    r = live(engine, words(WORDS * 2, 0.02), forced_tokens=200)
    got = 0
    async for _chunk in engine.stream(r):
        got += 1
        engine.abort(r.request_id)
    assert got >= 1 and engine.stats().active_streams == 0


async def test_voice_conversion_takes_no_streamed_text(engine):
    with pytest.raises(InvalidInput, match="no streamed text"):
        async for _ in engine.stream(live(engine, words(WORDS), mode=Mode.VC, source_wav=str(engine.prompt))):
            pass
