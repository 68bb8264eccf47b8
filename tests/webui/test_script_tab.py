"""The script desk's listener against the fake engine: progress per sentence, the finished take with its
subtitles, the live channel fed and closed, and bad scripts as gr.Error."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import soundfile as sf

from engine.config import Limits
from engine.lexicons import LexiconLibrary
from engine.request import Mode
from engine.text.script import TAG_HELP
from tests.api.support import RecordingEngine
from tests.sounds import write_wav
from webui.handlers import Studio, owner_of
from webui.script_tab import BREAK_TAG, PROMPT, SPEAKERS, TAG_KEYS, ScriptDesk, progress_html, tags_html
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


def inputs(desk, script, names=("Alice", "Bob"), voices=None, rid=RID, browser_id="", lexicon=""):
    engine = desk.studio.engine
    voices = voices or (engine.amy, PROMPT)
    names = [*names, *[""] * (SPEAKERS - len(names))]
    voices = [*voices, *[None] * (SPEAKERS - len(voices))]
    return [script, 0.25, *names, *voices, rid, browser_id, engine.prompt, "A prompt.", lexicon]


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
    en = progress_html(3, 12, 20.0, 6.0, Texts("en"))
    assert "Sentences 3 / 12" in en and "about 18 s left" in en and 'style="width:25.0%"' in en
    zh = progress_html(3, 12, 20.0, 6.0, Texts("zh"))
    assert "句子 3 / 12" in zh and "约剩 18 s" in zh and "Sentences" not in zh


async def test_a_chinese_session_gets_chinese_notes_and_errors(desk):
    zh = ScriptDesk(desk.studio.in_language(Texts("zh")))
    with pytest.raises(gr.Error) as err:
        async for _ in zh.perform(*inputs(desk, "Carol: hi", ("Carol",), (None,))):
            pass
    assert err.value.message == Texts("zh")("script_err_no_voice", name="Carol")
    choices = (await zh.voices(""))[0].choices
    assert choices[0] == (Texts("zh")("script_prompt_voice"), PROMPT)


def test_every_tag_the_model_knows_is_explained_in_both_languages():
    assert set(TAG_KEYS) == {BREAK_TAG, *TAG_HELP}
    for lang in ("en", "zh"):
        help_html = tags_html(Texts(lang))
        assert all(html.escape(tag) in help_html for tag in TAG_KEYS), lang
    assert "a sigh" in tags_html(Texts("en")) and "一声叹息" in tags_html(Texts("zh"))


def test_random_weights_say_the_timings_are_noise():
    from engine.serving.performance import PartDone
    from engine.serving.subtitles import Word
    from webui.script_tab import result_html

    part = PartDone(0, 1, "Alice", "Hi there", 0.0, 1.0, (Word("Hi", 0.1, 0.4), Word("there", 0.4, 0.9)))
    en = Texts("en")
    noisy, clean = (
        result_html("webui/audio/x.wav", [part], en, True),
        result_html("webui/audio/x.wav", [part], en, False),
    )
    note = en("script_noise")
    assert note in noisy and note not in clean
    assert '<span class="cosy-w" data-s="0.400" data-e="0.900">there</span>' in clean


async def test_the_take_is_timed_by_the_engines_word_timer_and_a_bug_is_not_shown(desk):
    """The desk asks the engine's ``word_timer`` (the server's Whisper) for the words' times; a timer that
    fails with an unexpected error ends the take with the page's "could not finish" message, not the
    exception's text (which goes to the log)."""
    from engine.serving.subtitles import Word

    class Timer:
        def __init__(self, fail: Exception | None = None) -> None:
            self.fail = fail

        def words(self, pcm, sample_rate, language=None):
            if self.fail is not None:
                raise self.fail
            return [Word("One.", 0.05, 0.15)]

    engine = desk.studio.engine
    engine.word_timer = Timer()
    updates = [u async for u in desk.perform(*inputs(desk, "Alice: One."))]
    srt = Path(updates[-1][2][1]).read_text()
    assert "00:00:00,050 --> 00:00:00,150\nAlice: One." in srt
    engine.word_timer = Timer(KeyError("a private detail"))
    with pytest.raises(gr.Error) as err:
        async for _ in desk.perform(*inputs(desk, "Alice: One.")):
            pass
    assert err.value.message == Texts("en")("err_internal") and "private" not in err.value.message


async def test_stop_keeps_the_take_so_far_with_named_subtitles_and_readable_files(desk):
    script = "Alice: One. Two!\nBob: Three.\nAlice: Four.\nBob: Five."
    updates = []
    async for update in desk.perform(*inputs(desk, script)):
        updates.append(update)
        if 'data-done="2"' in update[0]:
            desk.studio.stop(RID)  # as the page's Stop does, between two sentences
    progress, page, files = updates[-1]
    assert 'data-state="stopped"' in progress and 'data-done="2" data-total="4"' in progress
    assert "Stopped after sentence 2 of 4" in html.unescape(progress)
    wav, srt, vtt = (Path(f) for f in files)
    stem = r"\d{4}-\d\d-\d\d_\d{4}_Alice-Bob_One-Two-Three-Four-Five"
    assert [re.fullmatch(stem + r"\.(wav|srt|vtt)", f.name) is not None for f in (wav, srt, vtt)] == [
        True
    ] * 3
    audio, rate = sf.read(wav, dtype="float32")
    assert audio.size >= 2 * 2 * int(0.2 * rate)  # both finished sentences, at least
    assert "Alice: One. Two!" in srt.read_text() and "Bob: Three." in srt.read_text()
    assert "<v Bob>Three." in vtt.read_text() and "Four" not in srt.read_text()
    assert f"webui/audio/{RID}.wav" in page


BROWSER = "c" * 32


async def test_the_lexicon_is_applied_to_every_spoken_line_and_nowhere_else(desk, tmp_path):
    """Speaker names and tags stay as typed; the progress line of the take says where entries applied."""
    engine = desk.studio.engine
    engine.lexicons = LexiconLibrary(tmp_path / "voices", "cosyvoice3")
    entries = [{"word": "Nike", "hint": "N AY1 K IY0"}, {"word": "Alice", "hint": "AE1 L IH0 S"}]
    mine = engine.lexicons.save("Brands", entries, owner_of(BROWSER))
    script = "Alice: Nike [breath] runs.\nBob: Buy nike now."
    args = inputs(desk, script, browser_id=BROWSER, lexicon=mine.id)
    updates = [u async for u in desk.perform(*args)]
    said = [q.text for q in engine.requests]
    assert said == ["[N][AY1][K][IY0] [breath] runs.", "Buy [N][AY1][K][IY0] now."]
    assert "Pronounced from the lexicon: Nike×2." in html.unescape(updates[-1][0])
    assert 'data-state="done"' in updates[-1][0]


async def test_a_lexicon_not_of_this_browser_is_refused_before_any_line(desk, tmp_path):
    engine = desk.studio.engine
    engine.lexicons = LexiconLibrary(tmp_path / "voices", "cosyvoice3")
    theirs = engine.lexicons.save("Theirs", [{"word": "Nike", "hint": "N AY1 K IY0"}], owner_of("d" * 32))
    with pytest.raises(gr.Error, match="That lexicon cannot be used"):
        async for _ in desk.perform(*inputs(desk, "Alice: Nike.", browser_id=BROWSER, lexicon=theirs.id)):
            pass
    assert engine.requests == []


async def test_the_desk_lists_the_browsers_lexicons(desk, tmp_path):
    engine = desk.studio.engine
    engine.lexicons = LexiconLibrary(tmp_path / "voices", "cosyvoice3")
    engine.lexicons.save("Mine", [{"word": "Nike", "hint": "N AY1 K IY0"}], owner_of(BROWSER))
    engine.lexicons.save("Theirs", [{"word": "Nike", "hint": "N AY1 K IY0"}], owner_of("d" * 32))
    picker = await desk.lexicons(BROWSER)
    assert [value for _, value in picker.choices] == ["", "mine"]


async def test_the_speakers_kept_voices_are_picked_again_while_listed(desk):
    """On load the browser sends each speaker's voice it picked last (keep.js, JSON): a listed voice or the
    prompt box is picked again; one no longer listed, or storage that is not a list, gives the default."""
    engine = desk.studio.engine
    kept = json.dumps([PROMPT, "gone-voice", None, engine.amy])
    picks = [d.value for d in await desk.voices("", kept)]
    assert picks == [PROMPT, None, None, engine.amy] and len(picks) == SPEAKERS
    defaults = [d.value for d in await desk.voices("", "[]")]
    assert defaults == [engine.amy, None, None, None]
    assert [d.value for d in await desk.voices("", "{not json")] == defaults
    assert [d.value for d in await desk.voices("", '{"a": 1}')] == defaults
    page = await desk.page("", json.dumps([None, engine.amy]))
    assert [d.value for d in page[:SPEAKERS]] == [engine.amy, engine.amy, None, None]
