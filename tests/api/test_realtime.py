"""``WS /v1/audio/speech/realtime`` with a real WebSocket client (``websockets``) against a live uvicorn on
127.0.0.1 serving the API over the real engine on the tiny cosyvoice3 model (demo-tiny's model)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from api.app import build_api
from engine.config import EngineConfig, Limits
from engine.demo.make_model import build_model_dir
from engine.serving.engine import TTSEngine
from tests.api.support import live_server, wait_until
from tests.conftest import WAIT_S
from tests.sounds import speech_like

KEY = "sk-realtime"
TEXT = "Hello there, this text is written while it is spoken, word by word."


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[TTSEngine]:
    root = tmp_path_factory.mktemp("realtime")
    cfg = EngineConfig(
        model=str(build_model_dir(root / "model", "cosyvoice3", "tiny")),
        device="cpu",
        backend="native",
        voices_dir=str(root / "voices"),
        limits=Limits(
            max_concurrency=2, max_queue=4, max_text_chars=300, request_timeout_s=120, text_idle_s=120
        ),
    )
    eng = TTSEngine.load(cfg)
    eng.ready = True
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def url(engine: TTSEngine) -> Iterator[str]:
    with live_server(build_api(engine, engine.cfg.limits, api_key=KEY)) as base:
        yield base.replace("http://", "ws://") + "/v1/audio/speech/realtime"


def ref_audio() -> str:
    buf = io.BytesIO()
    sf.write(buf, speech_like(2.0), 24000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def session(**kw: Any) -> dict[str, Any]:
    base = {"mode": "cross_lingual", "ref_audio": ref_audio(), "response_format": "pcm", "seed": 3}
    return {"type": "session.update", "session": base | kw}


def events(ws: ClientConnection) -> Iterator[dict[str, Any]]:
    while True:
        try:
            yield json.loads(ws.recv(timeout=120))
        except ConnectionClosed:
            return


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


@contextmanager
def open_session(url: str, **kw: Any) -> Iterator[ClientConnection]:
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}, open_timeout=WAIT_S) as ws:
        ws.send(json.dumps(session(**kw)))
        yield ws


def test_text_streams_in_and_audio_streams_out(url: str, engine: TTSEngine) -> None:
    words = iter(TEXT.split(" "))  # a generator standing in for an LLM
    with open_session(url, sample_rate=16000) as ws:
        it = events(ws)
        opened = next(it)
        assert opened["type"] == "session.updated" and opened["session"]["sample_rate"] == 16000
        for i, word in enumerate(words):
            send(ws, "input_text_buffer.append", text=word if i == 0 else " " + word)
            if i == 7:
                break
        first = next(it)  # audio before the text is complete
        assert first["type"] == "response.audio.delta"
        for word in words:
            send(ws, "input_text_buffer.append", text=" " + word)
        send(ws, "input_text_buffer.commit")
        rest = list(it)
    kinds = [e["type"] for e in rest]
    assert kinds[-2:] == ["response.audio.done", "response.done"] and set(kinds[:-2]) <= {
        "response.audio.delta"
    }
    pcm = b"".join(base64.b64decode(e["delta"]) for e in [first, *rest[:-2]])
    audio = np.frombuffer(pcm, "<i2")
    done = rest[-1]["response"]
    assert done["status"] == "completed" and done["id"] == opened["session"]["id"]
    seconds = done["metrics"]["audio_s"]
    assert abs(len(audio) - seconds * 16000) <= 16000 * 0.01  # resampled to 16 kHz, nothing lost
    assert done["metrics"]["ttfa_ms"] > 0 and np.abs(audio).max() > 0


def test_a_wrong_key_gets_an_error_event(url: str) -> None:
    with connect(url, additional_headers={"Authorization": "Bearer nope"}) as ws:
        event = json.loads(ws.recv(timeout=WAIT_S))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=WAIT_S)
    assert event == {
        "type": "error",
        "error": {"message": "invalid API key", "type": "authentication_error", "param": None,
                  "code": "invalid_api_key"},
    }  # fmt: skip
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def speak_to_the_end(ws: ClientConnection) -> list[dict[str, Any]]:
    send(ws, "input_text_buffer.append", text="Hello there.")
    send(ws, "input_text_buffer.commit")
    return list(events(ws))


@pytest.mark.parametrize(
    ("first", "code", "param"),
    [
        ({"type": "input_text_buffer.append", "text": "hi"}, "invalid_event", "type"),
        ({"type": "session.update", "session": {"response_format": "mp3"}}, "invalid_value", None),
        (
            {"type": "session.update", "session": {"sample_rate": "fast"}},
            "invalid_value",
            "session.sample_rate",
        ),
        ({"type": "session.update", "session": ["voice"]}, "invalid_type", "session"),
    ],
    ids=["append-before-session", "bad-format", "wrong-type", "session-not-an-object"],
)
def test_a_refused_session_event_gets_an_error_and_a_fixed_one_is_served(
    url: str, first: dict[str, Any], code: str, param: str | None
) -> None:
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps(first | {"event_id": "evt-1"}))
        error = json.loads(ws.recv(timeout=120))
        ws.send(json.dumps(session()))
        assert json.loads(ws.recv(timeout=120))["type"] == "session.updated"
        rest = speak_to_the_end(ws)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == code and error["error"]["event_id"] == "evt-1"
    assert error["error"]["event_type"] == first["type"]
    assert param is None or error["error"]["param"] == param
    assert rest[-1]["type"] == "response.done" and rest[-1]["response"]["status"] == "completed"


def test_an_unknown_voice_ends_the_session_with_one_error(url: str) -> None:
    """The error names the event's field (before: the speech route's name, "voice")."""
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        send(ws, "session.update", session={"voice": "nobody"})
        send(ws, "input_text_buffer.append", text="Hello there.")
        with suppress(ConnectionClosed):  # the first text may already have ended the session
            send(ws, "input_text_buffer.commit")
        got = [e for e in events(ws) if e["type"] == "error"]
    assert (
        len(got) == 1
        and got[0]["error"]["code"] == "voice_not_found"
        and got[0]["error"]["param"] == "session.voice"
    )


HOSTILE = [  # (what the client sends, the error code, the param); each before any text
    (b"\x00\x01binary", "binary_frame", None),
    ("{not json", "invalid_json", None),
    ('["a list"]', "invalid_event", "type"),
    ({"type": 7}, "invalid_event", "type"),
    ({"type": "conversation.item.create", "event_id": "e3"}, "unknown_event", "type"),
    ({"type": "input_text_buffer.append", "text": 5, "event_id": "e4"}, "invalid_type", "text"),
    ({"type": "input_text_buffer.append", "event_id": "e5"}, "invalid_type", "text"),
    (
        {"type": "session.update", "session": {"voice": "other"}, "event_id": "e6"},
        "session_already_open",
        "type",
    ),
]


def test_hostile_events_get_precise_errors_and_the_session_goes_on(url: str, engine: TTSEngine) -> None:
    with open_session(url) as ws:
        it = events(ws)
        assert next(it)["type"] == "session.updated"
        errors = []
        for frame, _, _ in HOSTILE:
            ws.send(frame if isinstance(frame, (bytes, str)) else json.dumps(frame))
            errors.append(next(it))  # each answered before the next is sent: one error per bad event
        rest = speak_to_the_end(ws)
    for (frame, code, param), event in zip(HOSTILE, errors, strict=True):
        assert event["type"] == "error", event
        body = event["error"]
        assert (body["type"], body["code"], body["param"]) == ("invalid_request_error", code, param)
        if isinstance(frame, dict) and isinstance(frame["type"], str):
            assert body["event_type"] == frame["type"] and body["event_id"] == frame.get("event_id")
        assert "empty" not in body["message"]  # none is mistaken for "the text to speak is empty"
    kinds = [e["type"] for e in rest]
    assert (
        "error" not in kinds
        and kinds[-1] == "response.done"
        and rest[-1]["response"]["status"] == "completed"
    )
    assert wait_until(lambda: engine.stats().active_streams == 0, 30)


def test_text_after_the_commit_is_refused_and_the_response_completes(url: str) -> None:
    with open_session(url) as ws:
        send(ws, "input_text_buffer.append", text="Hello there.")
        send(ws, "input_text_buffer.commit")
        send(ws, "input_text_buffer.append", text=" More.", event_id="late")
        got = list(events(ws))
    errors = [e["error"] for e in got if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("text_committed", "late")]
    assert got[-1]["type"] == "response.done" and got[-1]["response"]["status"] == "completed"


def test_too_much_text_is_an_error_event_and_the_server_keeps_serving(url: str) -> None:
    with open_session(url) as ws:
        send(ws, "input_text_buffer.append", text="word " * 80)
        errors = [e["error"] for e in events(ws) if e["type"] == "error"]
    assert errors and errors[0]["code"] == "text_too_long" and "the limit is 300" in errors[0]["message"]
    with open_session(url) as ws:
        send(ws, "input_text_buffer.append", text="Hello there.")
        send(ws, "input_text_buffer.commit")
        assert [e["type"] for e in events(ws)][-1] == "response.done"


def test_a_client_that_leaves_aborts_its_request(url: str, engine: TTSEngine) -> None:
    with open_session(url) as ws:
        it = events(ws)
        next(it)
        for word in TEXT.split(" "):
            send(ws, "input_text_buffer.append", text=" " + word)
        assert next(it)["type"] == "response.audio.delta"  # computing
        cancelled = engine.stats().cancelled
    assert wait_until(lambda: engine.stats().cancelled == cancelled + 1)
    assert wait_until(lambda: engine.stats().active_streams == 0)


@pytest.mark.parametrize("last_frame", [None, b"\x00binary"], ids=["plain", "after-a-binary-frame"])
def test_a_client_that_leaves_before_the_commit_frees_its_stream_at_once(
    url: str, engine: TTSEngine, last_frame: bytes | None
) -> None:
    """The text is never completed: only the abort frees the stream (the engine's request timeout and the
    text idle timeout are minutes, the ceiling here is well under them)."""
    with open_session(url) as ws:
        it = events(ws)
        next(it)
        send(ws, "input_text_buffer.append", text=TEXT)
        assert next(it)["type"] == "response.audio.delta"
        if last_frame is not None:
            ws.send(last_frame)
        assert engine.stats().active_streams == 1
    assert wait_until(lambda: engine.stats().active_streams == 0, 60)


def test_text_with_nothing_speakable_is_a_422_error_event(url: str) -> None:
    with open_session(url) as ws:
        send(ws, "input_text_buffer.append", text="\u200b\u200d ")
        send(ws, "input_text_buffer.append", text="\u0301\u0302\ufeff")
        send(ws, "input_text_buffer.commit")
        errors = [e["error"] for e in events(ws) if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "nothing_to_speak"
    assert errors[0]["type"] == "invalid_request_error" and "nothing to speak" in errors[0]["message"]


# ------------------------------------------------------------------ the same contract as HTTP (issue 58)


def raw_append(ws: ClientConnection, text_json: str) -> None:
    """An append whose text is written as raw JSON (a lone surrogate travels as an escape)."""
    ws.send('{"type": "input_text_buffer.append", "text": ' + text_json + "}")


def closing(ws: ClientConnection) -> tuple[list[dict[str, Any]], int | None]:
    """Every event up to the close, and the close code."""
    got: list[dict[str, Any]] = []
    try:
        while True:
            got.append(json.loads(ws.recv(timeout=120)))
    except ConnectionClosed as closed:
        return got, closed.rcvd.code if closed.rcvd is not None else None


@pytest.mark.parametrize(
    ("text_json", "code", "words"),
    [
        ('"bad \\ud800 x"', "invalid_unicode", "Unicode"),
        ('"a \\u0000 b"', "control_characters", "control characters"),
        ('"bell \\u0007"', "control_characters", "control characters"),
    ],
    ids=["lone-surrogate", "nul", "bell"],
)
def test_a_piece_http_refuses_is_refused_and_the_text_goes_on(
    url: str, text_json: str, code: str, words: str
):
    """Before: a lone surrogate gave internal_error, close 1011 and a traceback; NUL was spoken."""
    with open_session(url) as ws:
        raw_append(ws, text_json)
        send(ws, "input_text_buffer.append", text="Hello there.")
        send(ws, "input_text_buffer.commit")
        got, close_code = closing(ws)
    errors = [e["error"] for e in got if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == code and words in errors[0]["message"], errors
    assert errors[0]["param"] == "text" and got[-1]["type"] == "response.done", got[-1]
    assert got[-1]["response"]["status"] == "completed" and close_code == 1000


@pytest.mark.parametrize(
    ("text", "code"),
    [("\U0001f600\U0001f389", "nothing_to_speak"), ("Hi <speak>there</speak>", "unsupported_markup"),
     ("Hi [foo] there", "unsupported_markup"), ('Hi <break time="99s"/> there', "break_too_long")],
    ids=["emoji-only", "speak-tag", "bracket-tag", "long-break"],
)  # fmt: skip
def test_text_http_refuses_ends_the_request_before_any_audio(url: str, text: str, code: str) -> None:
    """Before: emoji-only text and unknown markup were spoken (the markup read aloud)."""
    with open_session(url) as ws:
        send(ws, "input_text_buffer.append", text=text)
        send(ws, "input_text_buffer.commit")
        got, close_code = closing(ws)
    kinds = [e["type"] for e in got]
    assert kinds == ["session.updated", "error"], kinds
    assert got[-1]["error"]["code"] == code and close_code == 1000


def test_text_over_the_limit_is_refused_at_once_not_after_its_audio(url: str, engine: TTSEngine) -> None:
    """Before: the limit was met by the engine as it reached that text, after the audio before it."""
    with open_session(url) as ws:
        send(ws, "input_text_buffer.append", text="Hello there. " * 20)  # 260 of the 300 characters
        send(ws, "input_text_buffer.append", text="And more text here. " * 3)
        got, close_code = closing(ws)
    errors = [e for e in got if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["text_too_long"] and close_code == 1000
    assert "response.done" not in [e["type"] for e in got]
    assert wait_until(lambda: engine.stats().active_streams == 0)


def test_voice_as_an_object_and_text_tokens_in_the_metrics(url: str, engine: TTSEngine, tmp_path) -> None:
    """Before: {"id": ...} was refused (HTTP takes it) and metrics.text_tokens was 0."""
    wav = tmp_path / "v.wav"
    sf.write(wav, speech_like(2.0), 24000)
    voice = engine.add_voice("object form", str(wav), "Hello there.", None, "")
    with open_session(url, ref_audio=None, mode=None, voice={"id": voice.id}) as ws:
        assert next(events(ws))["type"] == "session.updated"
        send(ws, "input_text_buffer.append", text="Hello there, again.")
        send(ws, "input_text_buffer.commit")
        got, _ = closing(ws)
    done = got[-1]["response"]
    assert done["status"] == "completed" and done["metrics"]["text_tokens"] > 0, done["metrics"]


def longest_zero_run(pcm: np.ndarray) -> int:
    zero = np.concatenate([[0], (pcm == 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(zero))
    return int((edges[1::2] - edges[0::2]).max()) if edges.size else 0


def test_a_break_on_the_speech_route_is_exact_silence_not_words(url: str, engine: TTSEngine) -> None:
    """Before: <break time="..."/> was read aloud ("break time equal sign ..."): now the real engine speaks
    the text around it and puts exact silence in its place, as scripts do."""
    base = url.replace("ws://", "http://").removesuffix("/v1/audio/speech/realtime")
    body = {
        "input": 'Hi. <break time="600ms"/> Yo.',
        "mode": "cross_lingual",
        "ref_audio": ref_audio(),
        "response_format": "pcm",
        "stream": False,
        "seed": 3,
    }
    r = httpx.post(
        f"{base}/v1/audio/speech", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    pcm = np.frombuffer(r.content, "<i2")
    assert longest_zero_run(pcm) >= 0.6 * 24000 and len(pcm) > 0.6 * 24000 + 2400
    assert wait_until(lambda: engine.stats().active_streams == 0)


def test_a_break_in_streamed_text_is_exact_silence_between_its_segments(url: str, engine: TTSEngine) -> None:
    """Before: the socket read the tag aloud. Now it means what it means on the speech route and in
    scripts, even when the tag arrives split over pieces; each segment is a request under the one id."""
    with open_session(url) as ws:
        opened = next(events(ws))
        for piece in ["Hi there. <bre", 'ak time="700ms"', "/> Yo", " again."]:
            send(ws, "input_text_buffer.append", text=piece)
        send(ws, "input_text_buffer.commit")
        got, close_code = closing(ws)
    kinds = [e["type"] for e in got]
    assert "error" not in kinds and kinds[-2:] == ["response.audio.done", "response.done"], kinds
    pcm = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in got[:-2]), "<i2")
    done = got[-1]["response"]
    assert done["status"] == "completed" and done["id"] == opened["session"]["id"] and close_code == 1000
    assert longest_zero_run(pcm) >= 0.7 * 24000 and len(pcm) > 0.7 * 24000 + 4800
    assert abs(done["metrics"]["audio_s"] - len(pcm) / 24000) < 0.05 and done["metrics"]["text_tokens"] > 0
    assert wait_until(lambda: engine.stats().active_streams == 0)
