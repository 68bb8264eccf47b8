"""engine/serving/performance.py: a two-voice script on a tiny engine, one stream, pauses exact to the
sample."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.config import EngineConfig, Limits
from engine.demo.make_model import build_model_dir
from engine.request import SynthesisRequest
from engine.serving.engine import TTSEngine
from engine.serving.performance import PartDone, perform
from engine.text.script import compile_script, parse_script
from tests.sounds import write_wav

SCRIPT = 'Alice: Hello Bob. <break time="250ms"/> Nice day.\nBob (cheerful): Hi Alice!'
GAP_S = 0.4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("cosyvoice3")
    cfg = EngineConfig(
        model=str(build_model_dir(root / "model", "cosyvoice3", "tiny")),
        device="cpu",
        backend="native",
        voices_dir=str(root / "voices"),
        limits=Limits(max_concurrency=4, max_queue=8),
    )
    eng = TTSEngine.load(cfg)
    eng.ready = True
    eng.voices_wavs = [write_wav(root / f"v{i}.wav", 3.0, seed=i) for i in (1, 2)]
    yield eng
    eng.close()


def cast(engine, tokens: int = 20) -> dict[str, SynthesisRequest]:
    # forced_tokens bounds the compute: random weights rarely sample a stop id
    return {
        name: SynthesisRequest(prompt_wav=str(wav), prompt_text="A prompt.", seed=3, forced_tokens=tokens)
        for name, wav in zip(("Alice", "Bob"), engine.voices_wavs, strict=True)
    }


def parts():
    return compile_script(parse_script(SCRIPT, ["Alice", "Bob"]), "cosyvoice3", gap_s=GAP_S)


async def test_two_voices_one_stream_with_exact_pauses(engine):
    out = [item async for item in perform(engine, parts(), cast(engine), timings=True)]
    audio = np.concatenate([x for x in out if isinstance(x, np.ndarray)])
    done = [x for x in out if isinstance(x, PartDone)]
    assert [(d.index, d.total, d.speaker, d.text) for d in done] == [
        (0, 3, "Alice", "Hello Bob."),
        (1, 3, "Alice", "Nice day."),
        (2, 3, "Bob", "Hi Alice!"),
    ]
    rate = engine.sample_rate
    assert done[-1].end_s * rate == pytest.approx(audio.size)
    for before, after, pause_s in ((done[0], done[1], 0.25), (done[1], done[2], GAP_S)):
        end, start = round(before.end_s * rate), round(after.start_s * rate)
        assert start - end == round(pause_s * rate)  # the pause, to the sample
        assert not audio[end:start].any() and audio[end - 1] != 0.0 and audio[start] != 0.0
        assert after.start_s - before.end_s == pytest.approx(pause_s)
    for d in done:
        assert d.words and d.start_s <= d.words[0].start_s < d.words[-1].end_s <= d.end_s + 1e-6
    assert [w.text for w in done[2].words] == ["Hi", "Alice!"]


class Recording:
    """The engine, noting which texts started and when each finished (an event per text)."""

    def __init__(self, engine):
        self.engine, self.sample_rate = engine, engine.sample_rate
        self.started: list[str] = []
        self.finished: dict[str, asyncio.Event] = {}

    async def stream(self, req):
        self.started.append(req.text)
        done = self.finished.setdefault(req.text, asyncio.Event())
        async for chunk in self.engine.stream(req):
            yield chunk
        done.set()


async def test_the_next_part_is_computed_while_the_current_one_is_delivered(engine):
    rec = Recording(engine)
    gen = perform(rec, parts(), cast(engine), lookahead=1)
    first = await anext(gen)  # the first chunk of part 0; the listener then holds still
    assert isinstance(first, np.ndarray) and first.size
    assert rec.started == ["Hello Bob.", "Nice day."]  # the look-ahead is bounded: Bob's line waits
    await asyncio.wait_for(rec.finished.setdefault("Nice day.", asyncio.Event()).wait(), 300)
    rest = [item async for item in gen]
    assert rec.started == ["Hello Bob.", "Nice day.", "Hi Alice!"] and isinstance(rest[-1], PartDone)


async def test_closing_the_stream_aborts_the_renders(engine):
    rec = Recording(engine)
    gen = perform(rec, parts(), cast(engine, tokens=1500), lookahead=2)  # 60 s a part: none ends first
    assert isinstance(await anext(gen), np.ndarray)
    assert engine.admission.active == 3 and len(rec.started) == 3
    await gen.aclose()
    assert engine.admission.active == 0 and not any(e.is_set() for e in rec.finished.values())
