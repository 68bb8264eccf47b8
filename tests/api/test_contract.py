"""One contract at every HTTP door (issue 58): the same text checks as the socket and scripts, every limit
before work with the limit in the message, 503 + Retry-After on every route while loading, bodies read
under a timeout, error messages of bounded size, OpenAI's speed range, ``forced_tokens`` ignored unless
allowed. The engine is the API tests' fake: whatever it would do, the API refuses first."""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

import api.script as script_route
from api.app import build_api
from engine.config import Limits
from engine.errors import InvalidInput
from engine.serving.startup import Timeline
from server.pending_engine import PendingEngine
from tests.api.support import RecordingEngine, assert_openai_error, client_for, live_server, wav_bytes
from tests.conftest import WAIT_S

SPEECH = "/v1/audio/speech"
SCRIPT = "/v1/audio/script"
BREAK_10S = '<break time="10s"/>'


@pytest.fixture
def engine() -> RecordingEngine:
    engine = RecordingEngine(n_chunks=4, chunk_s=0.2, delay_s=0.0)
    engine.add_voice("alice", "unused.wav", "the prompt transcript")
    return engine


def speech(**fields: Any) -> dict[str, Any]:
    return {"model": "tts-1", "input": "Hello there.", "voice": "alice", "stream": False} | fields


@pytest.mark.parametrize(
    ("text", "status", "code", "named"),
    [
        ("\U0001f600\U0001f389", 422, "nothing_to_speak", "nothing to speak"),
        ("...!!! \u2605", 422, "nothing_to_speak", "nothing to speak"),
        ("Hi \x00 there", 422, "control_characters", "control characters"),
        ("Hi \ud800 there", 422, "invalid_unicode", "Unicode"),
        ("<speak>Hello there</speak>", 422, "unsupported_markup", "'<speak>'"),
        ("Hello [foo] there", 422, "unsupported_markup", "'[foo]'"),
        ('Hello <break time="99s"/> there', 422, "break_too_long", "limit of 10 s"),
        ("Hello " + BREAK_10S * 31, 413, "too_much_silence", "the limit is 300 s"),
    ],
    ids=["emoji", "symbols", "nul", "surrogate", "speak", "bracket", "long-break", "much-silence"],
)
async def test_speech_refuses_what_every_door_refuses_before_the_engine(
    engine: RecordingEngine, text: str, status: int, code: str, named: str
) -> None:
    """Before: emoji and markup reached the engine (markup was read aloud: "break time equal sign ...")."""
    content = json.dumps(speech(input=text)).encode()  # ASCII JSON: a lone surrogate travels as \ud800
    async with client_for(build_api(engine, api_key="")) as client:
        r = await client.post(SPEECH, content=content, headers={"Content-Type": "application/json"})
    error = assert_openai_error(r, status, param="input")
    assert error["code"] == code and named in error["message"], error
    assert engine.requests == []  # refused before any work


async def test_the_models_own_tags_and_breaks_pass(engine: RecordingEngine) -> None:
    text = 'Hello [breath] there. <break time="500ms"/> <strong>Really</strong> [laughter]'
    async with client_for(build_api(engine, api_key="")) as client:
        r = await client.post(SPEECH, json=speech(input=text))
    assert r.status_code == 200, r.text
    assert engine.requests[-1].text == text  # the engine speaks the breaks as silence (engine.serving.pauses)


async def test_a_script_of_a_thousand_long_breaks_is_refused_at_once(engine: RecordingEngine) -> None:
    """Before: 1000 x <break time="10s"/> with timestamps returned a 640 MB JSON after 13 s."""
    body = {"script": "Alice: hi " + BREAK_10S * 1000, "voices": {"Alice": "alice"}, "timestamps": True}
    async with client_for(build_api(engine, api_key="")) as client:
        r = await client.post(SCRIPT, json=body)
    error = assert_openai_error(r, 413, param="script")
    assert error["code"] == "too_much_silence" and "the limit is 300 s" in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    ("limit", "value", "code"),
    [("MAX_SCRIPT_AUDIO_S", 1.0, "script_too_long"), ("MAX_RESPONSE_BYTES", 100_000, "response_too_large")],
)
async def test_a_scripts_audio_and_response_are_bounded_as_they_grow(
    engine: RecordingEngine, monkeypatch: pytest.MonkeyPatch, limit: str, value: float, code: str
) -> None:
    """Each part is 0.8 s here: the third passes either bound, and the script stops there."""
    monkeypatch.setattr(script_route, limit, value)
    body = {"script": "Alice: One.\nAlice: Two.\nAlice: Three.\nAlice: Four.", "voices": {"Alice": "alice"}}
    async with client_for(build_api(engine, api_key="")) as client:
        r = await client.post(SCRIPT, json=body | {"timestamps": True, "gap_ms": 0})
    error = assert_openai_error(r, 413)
    assert error["code"] == code and str(value).rstrip("0").rstrip(".") in error["message"], error
    assert len(engine.requests) < 4 and engine.active == {}


async def test_error_messages_quote_input_within_a_bound(engine: RecordingEngine) -> None:
    """Before: a 100,000-character model came back in a 100 KB error body."""
    huge = "m" * 100_000
    async with client_for(build_api(engine, api_key="")) as client:
        r = await client.post(SPEECH, json=speech(model=huge))
        card = await client.get(f"/v1/models/{huge[:5000]}")
    assert_openai_error(r, 404, param="model")
    assert len(r.content) < 2000 and len(card.content) < 2000


@pytest.mark.parametrize("allowed", [False, True])
async def test_forced_tokens_over_the_range_is_ignored_unless_the_server_allows_it(
    engine: RecordingEngine, allowed: bool
) -> None:
    """README: ignored unless the server allows it. Before: 5000 was a 422 on every server."""
    async with client_for(build_api(engine, Limits(forced_tokens=allowed), api_key="")) as client:
        r = await client.post(SPEECH, json=speech(forced_tokens=5000))
    if allowed:
        error = assert_openai_error(r, 422, param="forced_tokens")
        assert "3000" in error["message"]
    else:
        assert r.status_code == 200 and engine.requests[-1].forced_tokens is None


@pytest.fixture
def server(engine: RecordingEngine) -> Iterator[str]:
    with live_server(build_api(engine, Limits(body_timeout_s=0.5), api_key="sk-k")) as url:
        yield url


@pytest.mark.parametrize(
    ("speed", "model_speed"), [(0.25, 0.5), (0.4, 0.5), (1.5, 1.5), (3.0, 2.0), (4.0, 2.0)]
)
def test_openais_speed_range_with_a_time_stretch_past_the_models(
    server: str, engine: RecordingEngine, speed: float, model_speed: float
) -> None:
    """Before: 0.25 and 4 (OpenAI's range) were 422. The fake engine makes 0.8 s at any speed: what the
    model does not do itself is stretched, so the audio is 0.8 s x model speed / speed."""
    with openai.OpenAI(base_url=f"{server}/v1", api_key="sk-k", max_retries=0) as client:
        wav = client.audio.speech.create(
            model="tts-1", voice="alice", input="Hello there.", speed=speed, response_format="wav"
        ).content
    audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
    assert engine.requests[-1].speed == model_speed
    expected = 0.8 * model_speed / speed
    assert abs(len(audio) / rate - expected) < 0.01, (len(audio) / rate, expected)
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    assert abs(np.argmax(spectrum) * rate / len(audio) - 220) < 10  # the fake's 220 Hz: pitch kept


def test_a_body_that_never_arrives_is_dropped_after_the_timeout(server: str) -> None:
    """Before: Content-Length 5000 with 60 bytes sent held the connection open indefinitely."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        head = f"POST {SPEECH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-k\r\n"
        conn.sendall((head + "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n").encode())
        conn.sendall(b'{"input": "' + b"x" * 49)  # 60 bytes, then nothing
        started = time.monotonic()
        received = b""
        while chunk := conn.recv(65536):  # until the server closes the connection
            received += chunk
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"body_timeout" in received and time.monotonic() - started < WAIT_S


def test_a_slow_but_steady_upload_is_not_cut(server: str, engine: RecordingEngine) -> None:
    """Each piece within the timeout: the body arrives whole (the bound is on silence, not on size)."""
    data = b'{"model": "tts-1", "voice": "alice", "input": "Hello there.", "stream": false}'

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(data), 20):
            time.sleep(0.2)  # under the 0.5 s timeout, about 0.8 s in all: longer than one timeout
            yield data[i : i + 20]

    headers = {"Authorization": "Bearer sk-k", "Content-Type": "application/json"}
    r = httpx.post(f"{server}{SPEECH}", content=pieces(), headers=headers, timeout=WAIT_S)
    assert r.status_code == 200, r.text


async def test_every_route_answers_503_with_retry_after_while_loading() -> None:
    """Before: transcription said 501 asr_disabled ("started with --asr-model none") and whisper-1 was 404."""
    loading = PendingEngine("/models/cosyvoice3", lambda: None, Timeline())  # not started: loading
    files = {"file": ("a.wav", wav_bytes(1.0), "audio/wav")}
    async with client_for(build_api(loading, api_key="")) as client:
        answers = [
            await client.post("/v1/audio/transcriptions", files=files, data={"model": "whisper-1"}),
            await client.get("/v1/models/whisper-1"),
            await client.post(SPEECH, json=speech()),
            await client.post(SCRIPT, json={"script": "hi", "voices": {"A": "alloy"}}),
        ]
    for r in answers:
        error = assert_openai_error(r, 503)
        assert error["code"] == "not_ready" and int(r.headers["retry-after"]) >= 1, (r.request.url, error)


class Refusing(RecordingEngine):
    """Refuses every voice with the engine's error of one field (None: the audio checks name none)."""

    def __init__(self, field: str | None):
        super().__init__()
        self.field = field

    def add_voice(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidInput("refused", field=self.field)


@pytest.mark.parametrize(
    ("field", "param"),
    [("name", "name"), ("prompt_text", "ref_text"), ("consent", "consent"), (None, "audio_sample")],
)
async def test_a_refused_voice_names_the_form_field_at_fault(field: str | None, param: str) -> None:
    """Before: the engine's field name (prompt_text) or null came back as param."""
    files = {"audio_sample": ("a.wav", wav_bytes(2.0), "audio/wav")}
    async with client_for(build_api(Refusing(field), api_key="")) as client:
        r = await client.post("/v1/audio/voices", data={"name": "n", "ref_text": "t"}, files=files)
    assert_openai_error(r, 422, param=param)


async def test_a_mid_stream_error_event_names_the_routes_field(engine: RecordingEngine) -> None:
    """Before: an SSE error event named the engine's field ("text"), not the route's ("input")."""
    engine.fail_after = InvalidInput("the text went wrong", field="text")
    async with client_for(build_api(engine, api_key="")) as client:
        r = await client.post(SPEECH, json=speech(stream_format="sse"))
    errors = [json.loads(line[6:]) for line in r.text.splitlines() if '"type":"error"' in line]
    assert errors and errors[0]["error"]["param"] == "input"
