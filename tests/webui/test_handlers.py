"""Studio handlers against the fake engine: every mode, bad inputs -> gr.Error, Stop aborts the engine."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr
import numpy as np
import pytest
import soundfile as sf

from engine.config import Limits
from engine.errors import Busy, NotReady, Stopping, Unspeakable
from engine.lexicons import LexiconLibrary
from engine.request import Mode, SynthesisRequest
from engine.serving.metrics import ServerStats
from tests.fakes import FakeEngine
from tests.sounds import write_wav
from webui import views
from webui.handlers import FORM_FIELDS, Account, Form, Studio, Studios, owner_of
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts

RID = "0123456789abcdef0123456789abcdef"
T = Texts("en")


class RecordingEngine(FakeEngine):
    """Remembers every request it was given."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.requests: list[SynthesisRequest] = []

    async def stream(self, req: SynthesisRequest) -> AsyncIterator:  # type: ignore[override]
        self.requests.append(req)
        async for chunk in super().stream(req):
            yield chunk


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine(n_chunks=3, chunk_s=0.2, delay_s=0.0)


@pytest.fixture
def studio(engine, tmp_path) -> Studio:
    return Studio(engine, Limits(max_text_chars=50), T, StreamHub(), AudioStore(tmp_path / "store"))


@pytest.fixture
def prompt(tmp_path) -> str:
    return str(write_wav(tmp_path / "prompt.wav", seconds=4.0))


def ui(**over: Any) -> dict[str, Any]:
    """Generate's inputs as the page sends them, zero-shot by default."""
    values: dict[str, Any] = {
        "mode": "zero_shot", "prompt_wav": None, "prompt_text": "hello there", "instruct_text": "",
        "source_wav": None, "voice_id": None, "language": "auto", "text": "Say this.", "stream": True,
        "speed": 1.0, "seed": -1, "rid": RID, "history": (),
    }  # fmt: skip
    values.update(over)
    return values


async def run(studio: Studio, **over: Any) -> list[tuple]:
    return [out async for out in studio.generate(Form(**ui(**over)))]


@pytest.mark.parametrize(
    ("mode", "extra", "expect"),
    [
        ("zero_shot", {}, {"mode": Mode.ZERO_SHOT, "prompt_text": "hello there"}),
        ("cross_lingual", {"prompt_text": ""}, {"mode": Mode.CROSS_LINGUAL, "prompt_text": ""}),
        (
            "instruct",
            {"instruct_text": "用广东话表达。"},
            {"mode": Mode.INSTRUCT, "instruct_text": "用广东话表达。"},
        ),
        ("vc", {"source_wav": "SOURCE", "text": ""}, {"mode": Mode.VC, "text": ""}),
    ],
)
async def test_each_mode_streams_and_saves(studio, engine, prompt, tmp_path, mode, extra, expect) -> None:
    if extra.get("source_wav") == "SOURCE":
        extra["source_wav"] = str(write_wav(tmp_path / "source.wav", seconds=2.0, seed=1))
    outs = await run(studio, mode=mode, prompt_wav=prompt, seed=11, **extra)
    assert len(outs) == engine.n_chunks + 1  # one live update per chunk, then the file
    req = engine.requests[-1]
    assert req.request_id == RID and req.seed == 11 and req.prompt_wav == prompt
    for key, value in expect.items():
        assert getattr(req, key) == value, key
    audio, metrics_html, status, history, history_html = outs[-1]
    pcm, rate = sf.read(audio["value"])
    assert rate == engine.sample_rate and len(pcm) == engine.n_chunks * int(0.2 * rate)
    assert audio["autoplay"] is False  # the live player already played it
    assert 'data-state="done"' in status and history[-1].mode == mode and RID in history_html
    assert 'data-metric="rtf">' in metrics_html


async def test_saved_voice_mode_sends_the_voice_id(studio, engine, prompt) -> None:
    engine.add_voice("alice", prompt, "hello there")
    await run(studio, mode="voice", voice_id="alice", prompt_wav=None)
    req = engine.requests[-1]
    assert (req.mode, req.voice_id, req.prompt_wav, req.prompt_text) == (Mode.ZERO_SHOT, "alice", None, "")


async def test_live_pcm_matches_the_final_file(studio, prompt) -> None:
    reader = asyncio.create_task(studio.hub.wait_open(RID, 5.0))
    outs = await run(studio, prompt_wav=prompt)
    assert await reader == 24000
    live = b"".join([b async for b in studio.hub.read(RID)])
    pcm, _ = sf.read(outs[-1][0]["value"], dtype="int16")
    live_pcm = np.frombuffer(live, "<i2").astype(np.int32)
    assert live_pcm.shape == pcm.shape and np.abs(live_pcm - pcm).max() <= 1  # 1 LSB: rounding modes


async def test_streaming_off_publishes_nothing_and_saves_the_file(studio, prompt) -> None:
    outs = await run(studio, prompt_wav=prompt, stream=False)
    assert await studio.hub.wait_open(RID, 1.0) is None
    assert outs[-1][0]["autoplay"] is False  # the page's player plays it (player.FINISHED_JS)
    assert studio.store.path(RID, "wav") == Path(outs[-1][0]["value"])


BAD_INPUTS = [
    ({"prompt_wav": None}, "upload or record"),
    ({"text": "   "}, "text is empty"),
    ({"text": "x" * 51}, "51 characters; the limit is 50"),
    ({"prompt_text": ""}, "needs the transcript"),
    ({"mode": "instruct", "instruct_text": " "}, "needs an instruction"),
    ({"mode": "vc", "text": ""}, "needs the source speech"),
    ({"mode": "voice", "voice_id": None}, "Pick a saved voice"),
    ({"speed": 3.0}, "speed must be within"),
    ({"mode": "sing"}, "mode 'sing'"),
]


def refusal(outs: list[tuple]) -> str:
    """The one update of a request its inputs stopped: the status "refused" (its message, unescaped),
    nothing else changed but the metrics, cleared."""
    assert len(outs) == 1
    audio, metrics, status, history, view = outs[0]
    assert all(isinstance(u, dict) and u == {"__type__": "update"} for u in (audio, history, view))
    assert 'data-state="refused"' in status and "—" in metrics
    return html.unescape(status)


@pytest.mark.parametrize(("over", "message"), BAD_INPUTS)
async def test_bad_inputs_say_why_in_the_status(studio, engine, prompt, over, message) -> None:
    values = {"prompt_wav": prompt, **over}
    assert message in refusal(await run(studio, **values))
    if await studio.hub.wait_open(RID, 1.0):  # the browser's player is released at once
        assert [b async for b in studio.hub.read(RID)] == []  # (engine errors: opened, then ended)
    assert not engine.active


@pytest.mark.parametrize(("seconds", "message"), [(1.0, "too short"), (31.0, "too long")])
async def test_prompt_duration_is_checked(studio, tmp_path, seconds, message) -> None:
    path = str(write_wav(tmp_path / "p.wav", seconds=seconds, sr=16000))
    assert message in refusal(await run(studio, prompt_wav=path))


async def test_unreadable_prompt(studio, tmp_path) -> None:
    path = tmp_path / "junk.wav"
    path.write_bytes(b"not audio at all" * 10)
    said = refusal(await run(studio, prompt_wav=str(path)))
    assert "could not be read" in said and "Error" not in said  # the decoder's exception stays in the log
    assert "Error" not in studio.prompt_info(str(path))


async def test_engine_busy_becomes_a_busy_message(studio, engine, prompt, monkeypatch) -> None:
    def busy(req: SynthesisRequest) -> None:
        raise Busy("64 requests are waiting", retry_after_s=7.2)

    monkeypatch.setattr(engine, "check", busy)
    # the engine's Retry-After estimate, rounded up: the visitor is told when to come back
    status = (await run(studio, prompt_wav=prompt))[-1][2]
    assert 'data-state="failed"' in status
    assert "The server is busy: retry in 8 s." in status and "64" not in status  # the queue is the log's


class EndingEngine(FakeEngine):
    """Streams ``ok_chunks`` chunks, then fails the way ``fail`` says (an engine error to raise)."""

    def __init__(self, fail: Exception, ok_chunks: int = 2):
        super().__init__(n_chunks=6, chunk_s=0.1, delay_s=0.0)
        self.fail, self.ok_chunks = fail, ok_chunks

    async def stream(self, req: SynthesisRequest) -> AsyncIterator:  # type: ignore[override]
        n = 0
        async for chunk in super().stream(req):
            if n == self.ok_chunks:
                raise self.fail
            n += 1
            yield chunk


@pytest.mark.parametrize("lang", ["en", "zh"])
async def test_a_shutdown_mid_take_is_no_busy_server_and_keeps_the_audio(prompt, tmp_path, lang) -> None:
    t = Texts(lang)
    engine = EndingEngine(Stopping("the server is shutting down; retry in a moment", retry_after_s=5.0))
    studio = Studio(engine, Limits(), t, StreamHub(), AudioStore(tmp_path))
    audio, _, status, history, table = (await run(studio, prompt_wav=prompt))[-1]
    assert 'data-state="failed"' in status and t("err_stopping") in status  # Retry: it may come back
    assert t("err_busy", seconds=5) not in status and "moment" not in status and "replica" not in status
    assert sf.info(audio["value"]).duration == pytest.approx(0.2)  # the two chunks made before the end
    assert history[-1].failed and history[-1].audio_s == pytest.approx(0.2)
    assert t("h_failed") in table and f"webui/audio/{RID}.wav" in table


async def test_a_failure_before_any_audio_keeps_nothing(prompt, tmp_path) -> None:
    engine = EndingEngine(RuntimeError("frame 349"), ok_chunks=0)
    studio = Studio(engine, Limits(), T, StreamHub(), AudioStore(tmp_path))
    audio, _, status, _, _ = (await run(studio, prompt_wav=prompt))[-1]
    assert 'data-state="failed"' in status and T("err_internal") in status and "frame" not in status
    assert audio is gr.skip() or audio == gr.skip()
    assert studio.store.path(RID, "wav") is None


@pytest.mark.parametrize("lang", ["en", "zh"])
async def test_unspeakable_text_is_not_started_in_the_pages_language(prompt, tmp_path, lang) -> None:
    t = Texts(lang)
    engine = EndingEngine(Unspeakable("the text has nothing to speak after normalisation"), ok_chunks=0)
    studio = Studio(engine, Limits(), t, StreamHub(), AudioStore(tmp_path))
    status = (await run(studio, prompt_wav=prompt, text="…！？"))[-1][2]
    assert 'data-state="refused"' in status and t("err_unspeakable") in status  # no Retry (css: on failed)
    if lang == "zh":
        assert not re.search(r"[A-Za-z]", html.unescape(re.sub(r"<[^>]+>", " ", status)))


def test_the_starting_server_is_said_so(studio) -> None:
    assert studio.engine_message(NotReady("the model is still loading", 4.2)) == T("err_starting", seconds=5)


async def test_an_example_voice_is_named_in_the_history(tmp_path) -> None:
    """Gradio hands the handler its cached copy of an example's file: same name, same bytes."""
    for folder in ("voices", "gradio", "upload"):
        (tmp_path / folder).mkdir()
    example = write_wav(tmp_path / "voices" / "en-amy.wav", seconds=4.0)
    cached = tmp_path / "gradio" / "en-amy.wav"
    cached.write_bytes(example.read_bytes())
    other = write_wav(tmp_path / "upload" / "en-amy.wav", seconds=4.0, seed=3)  # an upload with its name

    class Examples(FakeEngine):
        def example_voices(self) -> list[object]:
            return [SimpleNamespace(name="en-amy", wav=example, transcript="hi", language="en")]

    studio = Studio(Examples(delay_s=0.0), Limits(), T, StreamHub(), AudioStore(tmp_path / "store"))
    for path, voice in ((cached, "en-amy"), (other, "upload")):
        outs = await run(studio, mode="vc", prompt_wav=str(path), source_wav=str(other), text="")
        assert outs[-1][3][-1].voice == voice


def test_the_kept_history_comes_back_and_junk_is_dropped(studio) -> None:
    good = views.HistoryEntry(
        request_id="c" * 32, created_at=1.0, mode="zero_shot", text="hi", language="en", voice="upload",
        speed=1.0, seed=3, stream=True, ttfa_ms=None, rtf=0.5, audio_s=1.0, failed=True,
    )  # fmt: skip
    kept = json.loads(views.history_to_json([good]))
    junk = [{"request_id": "../x"}, {**kept[0], "request_id": "d" * 31}, {**kept[0], "seed": "7"}, 5, None]
    history, table = studio.restore_history(json.dumps(kept + junk))
    assert history == [good] and "c" * 32 in table
    assert studio.restore_history("not json") == ([], studio.history_view([]))
    assert studio.restore_history(None)[0] == []


async def test_stop_aborts_the_engine_and_keeps_the_partial_audio(prompt, tmp_path) -> None:
    engine = FakeEngine(n_chunks=200, chunk_s=0.1, delay_s=0.01)
    studio = Studio(engine, Limits(), T, StreamHub(), AudioStore(tmp_path))
    gen = studio.generate(Form(**ui(prompt_wav=prompt)))
    await gen.__anext__()
    await gen.__anext__()
    assert RID in engine.active
    studio.stop(RID)
    rest = [out async for out in gen]
    assert engine.aborted == [RID] and not engine.active
    audio, _, status, history, _ = rest[-1]
    assert 'data-state="stopped"' in status and history[-1].stopped
    assert 2 <= sf.info(audio["value"]).duration / 0.1 < 200


async def test_closing_the_listener_mid_stream_aborts(prompt, tmp_path) -> None:
    engine = FakeEngine(n_chunks=200, chunk_s=0.1, delay_s=0.01)
    studio = Studio(engine, Limits(), T, StreamHub(), AudioStore(tmp_path))
    gen = studio.generate(Form(**ui(prompt_wav=prompt)))
    await gen.__anext__()
    await gen.aclose()  # what Gradio does when the tab closes or the event is cancelled
    assert engine.aborted == [RID] and not engine.active


async def test_stop_while_queued_never_starts_the_engine(studio, engine, prompt) -> None:
    studio.stop(RID)
    outs = await run(studio, prompt_wav=prompt)
    assert engine.requests == [] and 'data-state="stopped"' in outs[-1][2]
    studio.stop("not-an-id")  # not a request id: ignored, not remembered
    assert "not-an-id" not in studio._stopped


async def test_history_accumulates_with_settings(studio, prompt) -> None:
    history: list = []
    for i, rid in enumerate(("a" * 32, "b" * 32)):
        outs = await run(studio, prompt_wav=prompt, rid=rid, history=history, speed=1.5, seed=i)
        history = outs[-1][3]
    assert [h.request_id for h in history] == ["a" * 32, "b" * 32]
    assert history[1].speed == 1.5 and history[1].seed == 1 and history[1].audio_s == pytest.approx(0.6)
    assert studio.store.path("a" * 32, "mp3") is not None


BROWSER_A, BROWSER_B = "a1" * 16, "b2" * 16


def refused(outputs: tuple, match: str) -> None:
    """A voice listener's refusal: the dropdown left as it is, the message in the note, in red."""
    dropdown, note = outputs
    assert (
        isinstance(dropdown, dict)
        and dropdown.get("__type__") == "update"
        and not dropdown.keys() - {"__type__"}
    )
    assert 'class="cosy-note cosy-bad"' in note and match in html.unescape(note), note


async def test_save_and_delete_voice(studio, engine, prompt) -> None:
    dropdown, note = await studio.save_voice("  alice ", prompt, "hello there", BROWSER_A)
    assert ("alice", "alice") in dropdown.choices and dropdown.value == "alice" and "alice" in note
    assert engine.voices[("studio:" + BROWSER_A, "alice")].prompt_text == "hello there"
    refused(await studio.save_voice(" ", prompt, "x", BROWSER_A), "name")
    refused(await studio.save_voice("bob", None, "x", BROWSER_A), "upload or record")
    dropdown, _ = await studio.delete_voice("alice", BROWSER_A)
    assert dropdown.choices == [] and engine.voices == {}
    refused(await studio.delete_voice("alice", BROWSER_A), "gone or not yours")


async def test_voices_belong_to_their_browser(studio, engine, prompt) -> None:
    """Browser B neither lists, uses nor deletes A's voice; a public voice is listed, marked, read-only."""
    engine.add_voice("Shared", prompt, "t", None)
    await studio.save_voice("Alice", prompt, "hello", BROWSER_A)
    assert await studio.voice_choices(BROWSER_A) == [("Alice", "alice"), ("Shared · public", "shared")]
    assert await studio.voice_choices(BROWSER_B) == [("Shared · public", "shared")]
    refused(await studio.delete_voice("alice", BROWSER_B), "gone or not yours")
    refused(await studio.delete_voice("shared", BROWSER_A), "only the server's operator")
    used = await run(studio, mode="voice", voice_id="alice", browser_id=BROWSER_B)
    assert 'data-state="refused"' in used[-1][2] and "gone or not yours" in used[-1][2]
    assert (await run(studio, mode="voice", voice_id="alice", browser_id=BROWSER_A))[-1][0] is not None
    for bad in ("", "not-a-browser-id", "A1" * 16):  # only ids drawn by the page's script are owners
        refused(await studio.save_voice("Eve", prompt, "t", bad), "browser id")


async def test_a_name_already_shown_is_refused(studio, engine, prompt) -> None:
    """Names are unique among the voices a browser sees: a clash says which voice has the name."""
    engine.add_voice("Alice", prompt, "t", None)
    refused(await studio.save_voice("alice", prompt, "t", BROWSER_A), "already named 'Alice'")
    await studio.save_voice("Alice 2", prompt, "t", BROWSER_A)
    assert await studio.voice_choices(BROWSER_A) == [
        ("Alice · public", "alice"), ("Alice 2", "alice 2")
    ]  # fmt: skip


def test_prompt_info_and_text_info(studio, prompt) -> None:
    assert "4.0 s" in studio.prompt_info(prompt) and "cosy-good" in studio.prompt_info(prompt)
    assert "No prompt" in studio.prompt_info(None)
    counter, split = studio.text_info("One. Two! " * 3, "en")
    # counted as Generate counts them: without the trailing blank (the error and the counter agree)
    assert "29 / 50 characters · segments: 1" in counter and split.count("<li>") == 1
    assert "cosy-over" in studio.text_info("x" * 51, "en")[0]


def test_dice_and_presets() -> None:
    seeds = {Studio.dice() for _ in range(20)}
    assert len(seeds) > 1 and all(0 <= s < 2**31 for s in seeds)
    assert Studio.pick_preset("请用广东话表达。") == "请用广东话表达。"


class CountingEngine(FakeEngine):
    audio_total = 0.0

    def stats(self) -> ServerStats:
        return ServerStats(active_streams=2, queued=1, audio_s_total=self.audio_total)


def test_server_panel_tracks_throughput(tmp_path, monkeypatch) -> None:
    engine = CountingEngine()
    studio = Studio(engine, Limits(), T, StreamHub(), AudioStore(tmp_path))
    clock = iter([0.0, 1.0, 1.2, 3.0])
    monkeypatch.setattr("webui.handlers.time.monotonic", lambda: next(clock))
    html = ""
    for total in (0.0, 4.0, 9.0, 10.0):  # the 1.2 s sample is too soon and is skipped
        engine.audio_total = total
        html = studio.server_panel()
    assert 'data-metric="active">2' in html and 'data-metric="queued">1' in html
    assert 'data-metric="throughput">3.00' in html  # (10 - 4) audio s over 2 s


def test_server_panel_says_warming_while_start_up_work_runs(tmp_path) -> None:
    """/ready's stage in the studio: while the engine's start-up timeline has work left (the LM handover,
    background graphs), the panel tells the visitor that the first audio may be slower; then nothing."""
    from engine.serving.startup import Timeline

    engine = CountingEngine()
    engine.startup = Timeline()
    studio = Studio(engine, Limits(), T, StreamHub(), AudioStore(tmp_path))
    zh = Studio(engine, Limits(), Texts("zh"), StreamHub(), AudioStore(tmp_path))
    with engine.startup.phase("flow graphs", background=True):
        panel = studio.server_panel()
        assert "cosy-warming" in panel and "first audio may be slower" in panel
        assert "预热" in zh.server_panel()
    assert "cosy-warming" not in studio.server_panel()


def test_generate_inputs_are_the_engines_files(studio, prompt) -> None:
    req = studio.build_request(Form(**ui(prompt_wav=prompt)))
    assert Path(req.prompt_wav).exists() and req.seed is None and req.language == "auto"


class SignedIn:
    """The part of ``gr.Request`` the studio reads: the session's user name and the browser's language."""

    def __init__(self, username: str | None, lang: str = "en"):
        self.username, self.headers = username, {"accept-language": lang}


async def test_a_login_session_saves_lists_and_uses_its_own_namespace(studio, engine, prompt) -> None:
    """With a login the session's namespace replaces whatever browser id the page sends, for every voice
    listener; a page cannot name a namespace itself (a plain string is only ever a browser id)."""
    accounts = {"alice~fp1": "api:key:k1", "bob~fp2": "api:key:k2"}
    studios = Studios(studio, "auto", accounts.get)
    save, choices = studios.listener("save_voice"), studios.listener("browser_voices")
    await save(SignedIn("alice~fp1"), "Mine", prompt, "hello", BROWSER_A)
    assert [owner for owner, _ in engine.voices] == ["api:key:k1"]
    field, dropdown, _ = await choices(SignedIn("alice~fp1"), BROWSER_B)  # another browser, same key
    assert field == "" and ("Mine", "mine") in dropdown.choices  # the namespace is never put in the page
    _, other, _ = await choices(SignedIn("bob~fp2"), BROWSER_A)  # the browser that saved it, another key
    assert ("Mine", "mine") not in other.choices
    generate = studios.listener("generate", Form.from_ui)
    form = Form(**ui(mode="voice", voice_id="mine", browser_id=BROWSER_B))
    args = [getattr(form, k) for k in FORM_FIELDS]  # the page's values, in its order
    assert [u async for u in generate(SignedIn("alice~fp1"), *args)][-1][0] is not None
    assert engine.requests[-1].voice_owner == "api:key:k1"
    # a session no key signed has no namespace
    refused(await save(SignedIn("mallory"), "Eve", prompt, "t", BROWSER_A), "browser id")
    assert await studio.voice_choices("api:key:k1") == []  # the page's plain string is no namespace
    assert Account("api:key:k1") == "api:key:k1"


async def test_the_kept_saved_voice_is_picked_again_only_while_listed(studio, prompt) -> None:
    """On load the browser sends the voice it picked last (keep.js): picked again while this browser still
    lists it; a voice gone (deleted, or another browser's) leaves the list unpicked with a note, no error."""
    await studio.save_voice("Mine", prompt, "hello", BROWSER_A)
    field, dropdown, note = await studio.browser_voices(BROWSER_A, "mine")
    assert field == BROWSER_A and dropdown.value == "mine" and note == ""
    _, theirs, note = await studio.browser_voices(BROWSER_B, "mine")  # not this browser's voice
    assert theirs.value is None and "cosy-bad" in note and "“mine”" in note
    assert Texts("en")("voice_not_kept", voice="mine") in html.unescape(note)
    _, none_kept, note = await studio.browser_voices(BROWSER_A, "")
    assert none_kept.value is None and note == ""


async def test_refusals_are_in_the_page_language(studio, prompt) -> None:
    studios = Studios(studio, "auto")
    form = Form(**ui(prompt_wav=None))
    generate = studios.listener("generate", Form.from_ui)
    outs = [u async for u in generate(SignedIn(None, "zh-CN"), *[getattr(form, k) for k in FORM_FIELDS])]
    assert Texts("zh")("status_refused", message=Texts("zh")("err_no_prompt")) in refusal(outs)
    save = studios.listener("save_voice")
    refused(await save(SignedIn(None, "zh-CN"), "", prompt, "t", BROWSER_A), Texts("zh")("err_no_voice_name"))


def test_detected_languages_are_named_never_coded() -> None:
    from webui.texts import language_name

    assert language_name("ja", Texts("en")) == "日本語 (Japanese)"
    assert language_name("de", Texts("zh")) == "德语" and language_name("de", Texts("en")) == "German"
    assert language_name("xx", Texts("zh")) == "其他语言"


async def test_transcription_notes_name_languages_and_keep_engine_words_in_the_log(
    engine, prompt, tmp_path, monkeypatch, caplog
) -> None:
    studio = Studio(engine, Limits(), Texts("zh"), StreamHub(), AudioStore(tmp_path / "store"))

    async def german(audio: object, language: str | None = None) -> Any:
        from engine.asr import Transcript

        return Transcript("Guten Tag", "de", 3.0)

    monkeypatch.setattr(engine, "transcribe", german)
    _, offered, note = await studio.transcribe(prompt, "auto")
    assert "德语" in note and "(de)" not in note and offered is not None

    async def broken(audio: object, language: str | None = None) -> Any:
        raise Busy("ModelError: whisper worker died")

    monkeypatch.setattr(engine, "transcribe", broken)
    _, _, note = await studio.transcribe(prompt, "auto")
    assert "无法识别" in note and "whisper" not in note and "ModelError" not in note
    assert "whisper worker died" in caplog.text


class FailingEngine(FakeEngine):
    """Streams one chunk, then fails the way an engine bug does (an exception no refusal names)."""

    async def stream(self, req: SynthesisRequest) -> AsyncIterator:  # type: ignore[override]
        async with contextlib.aclosing(super().stream(req)) as chunks:
            async for chunk in chunks:
                yield chunk
                raise RuntimeError("flow reuse: a chunk emits frame 349, inside its 350 cached frames")


@pytest.mark.parametrize("lang", ["en", "zh"])
async def test_an_engine_failure_ends_the_request_in_the_pages_language(
    prompt, tmp_path, caplog, lang
) -> None:
    engine = FailingEngine(n_chunks=3, chunk_s=0.2, delay_s=0.0)
    t = Texts(lang)
    studio = Studio(engine, Limits(), t, StreamHub(), AudioStore(tmp_path))
    outs = await run(studio, prompt_wav=prompt)
    audio, _, status, _, _ = outs[-1]
    assert 'data-state="failed"' in status and html.escape(t("err_internal")) in status
    assert "frame 349" not in status and "RuntimeError" not in status  # the engine's words stay in the log
    assert "frame 349" in caplog.text and "RuntimeError" in caplog.text
    assert not engine.active  # the engine is freed
    assert sf.info(audio["value"]).duration == pytest.approx(0.2)  # the chunk made before it is kept


async def test_a_missing_saved_voice_fails_with_the_translated_refusal(studio, engine) -> None:
    status = (await run(studio, mode="voice", voice_id="ghost", prompt_wav=None))[-1][2]
    assert 'data-state="refused"' in status and "gone or not yours" in status  # no Retry: it cannot work


def test_the_form_takes_the_pages_values_in_order() -> None:
    values = ["instruct", "/p.wav", None, "Speak slowly.", None, None, "en", "Hi.", False, 1.5, 7.0, RID]
    values += [[], "f" * 32, True, 6, "brands"]
    form = Form.from_ui(*values)
    assert (form.mode, form.prompt_wav, form.prompt_text, form.instruct_text) == (
        "instruct",
        "/p.wav",
        "",
        "Speak slowly.",
    )
    assert (form.stream, form.speed, form.seed, form.rid, form.history, form.live, form.wps) == (
        False, 1.5, 7.0, RID, (), True, 6
    )  # fmt: skip
    assert form.lexicon == "brands"
    with pytest.raises(ValueError):
        Form.from_ui(*values[:-1])  # one value short: the page and the form disagree


async def test_transcription_fills_an_untyped_transcript_and_keeps_a_typed_one(studio, prompt) -> None:
    text, offer, note = await studio.transcribe(prompt, "auto", "old words of an example", False)
    assert (text, offer) == ("fake transcript", "en") and "Transcribed as English;" in note
    text, offer, note = await studio.transcribe(prompt, "auto", "my own words", True)
    assert text == gr.skip() and offer == "en" and "fake transcript" in note and "Kept" in note
    assert studio.transcript_cleared(False) == ("", "")  # filled for the removed audio: it goes too
    assert studio.transcript_cleared(True)[0] == gr.skip()  # the visitor's words stay


async def test_an_unknown_detected_language_is_named_not_coded(studio, engine, prompt, monkeypatch) -> None:
    async def swahili(audio: object, language: str | None = None) -> Any:
        return type("T", (), {"text": "habari", "language": "sw"})()

    monkeypatch.setattr(engine, "transcribe", swahili)
    text, offer, note = await studio.transcribe(prompt, "auto", "", False)
    assert text == "habari" and offer == gr.skip() and "another language" in note and "sw" not in note


# ---- the Pronunciation picker (``engine.lexicons``) ------------------------------------------------------
ALICE, BOB = "a" * 32, "b" * 32
BRANDS = [{"word": "Nike", "hint": "N AY1 K IY0"}, {"word": "行", "hint": "hang2"}]


@pytest.fixture
def lexicons(engine, tmp_path) -> LexiconLibrary:
    engine.lexicons = LexiconLibrary(tmp_path / "voices", engine.family)  # type: ignore[attr-defined]
    return engine.lexicons  # type: ignore[attr-defined]


async def test_the_picked_lexicon_is_applied_and_the_status_says_where(
    studio, engine, prompt, lexicons
) -> None:
    mine = lexicons.save("Brands", BRANDS, owner_of(ALICE))
    text = "Nike, nike 行 and Adidas."
    outs = await run(studio, prompt_wav=prompt, text=text, browser_id=ALICE, lexicon=mine.id)
    assert engine.requests[-1].text == "[N][AY1][K][IY0], [N][AY1][K][IY0] [h][áng] and Adidas."
    status = outs[-1][2]
    assert 'data-state="done"' in status
    assert "Pronounced from the lexicon: Nike×2, 行×1." in html.unescape(status)
    assert outs[-1][3][-1].text == text  # the history and its downloads' names: as typed


async def test_no_lexicon_leaves_the_text_and_a_miss_is_said(studio, engine, prompt, lexicons) -> None:
    mine = lexicons.save("Brands", BRANDS, owner_of(ALICE))
    outs = await run(studio, prompt_wav=prompt, text="Nike.", browser_id=ALICE)
    assert engine.requests[-1].text == "Nike." and "lexicon" not in outs[-1][2]
    outs = await run(studio, prompt_wav=prompt, text="Adidas.", browser_id=ALICE, lexicon=mine.id)
    assert engine.requests[-1].text == "Adidas."
    assert "The lexicon matched no word of this text." in html.unescape(outs[-1][2])


async def test_another_browsers_lexicon_is_refused_before_the_engine(
    studio, engine, prompt, lexicons
) -> None:
    mine = lexicons.save("Brands", BRANDS, owner_of(ALICE))
    outs = await run(studio, prompt_wav=prompt, text="Nike.", browser_id=BOB, lexicon=mine.id)
    assert engine.requests == []
    status = html.unescape(outs[-1][2])
    assert 'data-state="refused"' in status and "That lexicon cannot be used" in status


async def test_a_server_without_lexicons_refuses_a_picked_one(studio, engine, prompt) -> None:
    outs = await run(studio, prompt_wav=prompt, text="Nike.", browser_id=ALICE, lexicon="brands")
    assert engine.requests == [] and "keeps no pronunciation lexicons" in html.unescape(outs[-1][2])


async def test_live_text_is_pronounced_as_it_arrives(lexicons) -> None:
    """Typed text reaches the engine in pieces: a word cut between two ("Ni" + "ke") is still found."""
    from engine.lexicons import StreamApplier
    from webui.handlers import lexicon_note, pronounced

    applier = StreamApplier(lexicons.save("Brands", BRANDS, owner_of(ALICE)))

    async def typed() -> AsyncIterator[str]:
        for piece in ("Ni", "ke says ", "行", " hi"):
            yield piece

    said = "".join([piece async for piece in pronounced(typed(), applier)])
    assert said == "[N][AY1][K][IY0] says [h][áng] hi"
    assert lexicon_note(T, applier.hits) == " Pronounced from the lexicon: Nike×1, 行×1."


async def test_the_picker_lists_the_public_and_the_browsers_own_lexicons(studio, lexicons) -> None:
    lexicons.save("Shared", BRANDS, None)
    lexicons.save("Mine", BRANDS, owner_of(ALICE))
    lexicons.save("Theirs", BRANDS, owner_of(BOB))
    choices = await studio.lexicon_choices(ALICE)
    assert choices == [("None", ""), ("Mine", "mine"), ("Shared (public)", "shared")]
    dropdown, note = await studio.browser_lexicons(BOB)
    assert [c[1] for c in dropdown.choices] == ["", "shared", "theirs"] and note == ""
    assert await Studio.lexicon_choices(studio, None) == [("None", ""), ("Shared (public)", "shared")]


async def test_the_kept_lexicon_is_picked_again_only_while_listed(studio, lexicons) -> None:
    """On load the browser sends the lexicon it picked last (keep.js): picked again while this browser
    still lists it (its own or a public one); one gone (deleted, or another browser's) leaves the picker
    on None with a note, no error."""
    lexicons.save("Mine", BRANDS, owner_of(ALICE))
    lexicons.save("Shared", BRANDS, None)
    for kept in ("mine", "shared"):
        dropdown, note = await studio.browser_lexicons(ALICE, kept)
        assert dropdown.value == kept and note == ""
    theirs, note = await studio.browser_lexicons(BOB, "mine")  # not this browser's lexicon
    assert theirs.value == "" and "cosy-bad" in note and "“mine”" in note
    assert Texts("en")("lexicon_not_kept", lexicon="mine") in html.unescape(note)
    lexicons.delete("mine", owner_of(ALICE))
    gone, note = await studio.browser_lexicons(ALICE, "mine")
    assert gone.value == "" and "“mine”" in note
    none_kept, note = await studio.browser_lexicons(ALICE, "")
    assert [c[1] for c in none_kept.choices] == ["", "shared"] and note == ""


async def test_the_lab_picks_a_lexicon_only_where_this_browser_has_it(studio, lexicons) -> None:
    lexicons.save("Mine", BRANDS, owner_of(ALICE))
    lexicons.save("Theirs", BRANDS, owner_of(BOB))
    assert (await studio.pick_lexicon("mine", ALICE)).value == "mine"
    assert (await studio.pick_lexicon("theirs", ALICE)).value != "theirs"
    assert (await studio.pick_lexicon("", ALICE)).value != "mine"
