"""The script desk's listener against the fake engine: progress per sentence, the finished take with its
subtitles, the live channel fed and closed, and bad scripts as gr.Error."""

from __future__ import annotations

import re
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import soundfile as sf

from engine.config import Limits
from engine.request import Mode
from tests.api.support import RecordingEngine
from tests.sounds import write_wav
from webui.handlers import Studio
from webui.script_tab import PROMPT, SPEAKERS, ScriptDesk, progress_html
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts

RID = "a" * 32


@pytest.fixture
def desk(tmp_path) -> ScriptDesk:
    engine = RecordingEngine(n_chunks=2, chunk_s=0.2, delay_s=0.0)
    wav = write_wav(tmp_path / "v.wav", 3.0)
    engine.amy = engine.add_voice("Amy", str(wav), "A prompt.", None).id
    engine.prompt = str(wav)
    return ScriptDesk(Studio(engine, Limits(), Texts("en"), StreamHub(), AudioStore(tmp_path / "store")))


def inputs(desk, script, names=("Alice", "Bob"), voices=None, rid=RID):
    engine = desk.studio.engine
    voices = voices or (engine.amy, PROMPT)
    names = [*names, *[""] * (SPEAKERS - len(names))]
    voices = [*voices, *[None] * (SPEAKERS - len(voices))]
    return [script, 0.25, *names, *voices, rid, "", engine.prompt, "A prompt."]


async def test_progress_then_the_take_with_subtitles(desk):
    hub = desk.studio.hub
    updates = [u async for u in desk.perform(*inputs(desk, "Alice: One. Two!\nBob (sad): Three."))]
    progress = [u[0] for u in updates]
    assert [re.search(r'data-done="(\d+)" data-total="(\d+)"', p).groups() for p in progress] == [
        ("0", "2"), ("1", "2"), ("2", "2"), ("2", "2"),
    ]  # fmt: skip
    _, page, files = updates[-1]
    wav, srt, vtt = (Path(f) for f in files)
    audio, rate = sf.read(wav, dtype="float32")
    engine = desk.studio.engine
    assert audio.size == 2 * 2 * int(0.2 * rate) + round(0.25 * rate)
    assert [(q.text, q.voice_id, q.mode) for q in engine.requests] == [
        ("One. Two!", engine.amy, Mode.ZERO_SHOT),
        ("Three.", None, Mode.INSTRUCT),
    ]
    assert engine.requests[1].prompt_wav == engine.prompt and engine.requests[1].instruct_text == "sad"
    assert srt.read_text().startswith("1\n00:00:00,") and vtt.read_text().startswith("WEBVTT")
    assert f"webui/audio/{RID}.wav" in page and page.count('class="cosy-w"') == 3
    assert await hub.wait_open(RID, 1.0) == rate  # the live channel was fed, then closed
    pcm = b"".join([b async for b in hub.read(RID)])
    assert len(pcm) // 2 == audio.size and np.abs(audio).max() > 0


@pytest.mark.parametrize(
    ("script", "names", "match"),
    [
        ("Alice: a <b>bold</b> word", ("Alice",), "unknown tag '<b>'"),
        ("Carol (loud): hi", ("Alice",), "speaker 'Carol' has no voice"),
        ("Alice: hi", ("",), "name at least one speaker"),
    ],
)
async def test_bad_scripts_are_gradio_errors_and_release_the_player(desk, script, names, match):
    hub = desk.studio.hub
    with pytest.raises(gr.Error) as err:
        async for _ in desk.perform(*inputs(desk, script, names)):
            pass
    assert match in err.value.message
    assert await hub.wait_open(RID, 1.0) is None and not desk.studio.engine.requests


def test_progress_states_the_time_left():
    html = progress_html(3, 12, 20.0, 6.0)
    assert "Sentences 3 / 12" in html and "about 18 s left" in html and 'style="width:25.0%"' in html


def test_random_weights_say_the_timings_are_noise():
    from engine.serving.performance import PartDone
    from engine.serving.subtitles import Word
    from webui.script_tab import NOISE_NOTE, result_html

    part = PartDone(0, 1, "Alice", "Hi there", 0.0, 1.0, (Word("Hi", 0.1, 0.4), Word("there", 0.4, 0.9)))
    noisy, clean = (
        result_html("webui/audio/x.wav", [part], True),
        result_html("webui/audio/x.wav", [part], False),
    )
    assert NOISE_NOTE in noisy and NOISE_NOTE not in clean
    assert '<span class="cosy-w" data-s="0.400" data-e="0.900">there</span>' in clean
