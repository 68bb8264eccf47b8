"""api/transcriptions.py and the ASR in the speech and voice routes (the fake engine's ASR records calls)."""

from __future__ import annotations

import httpx
import pytest

from api.app import build_api
from engine.config import Limits
from engine.request import Mode
from tests.api.support import assert_openai_error, b64, client_for, wav_bytes

ASR = "/v1/audio/transcriptions"


def upload(seconds: float = 2.0) -> dict[str, tuple[str, bytes, str]]:
    return {"file": ("prompt.wav", wav_bytes(seconds), "audio/wav")}


@pytest.mark.parametrize(
    ("fmt", "check"),
    [
        (
            "json",
            lambda r: r.json() == {"text": "fake transcript", "usage": {"type": "duration", "seconds": 3}},
        ),
        ("text", lambda r: r.text == "fake transcript" and "text/plain" in r.headers["content-type"]),
        (
            "verbose_json",
            lambda r: (
                r.json()["language"] == "japanese"
                and r.json()["duration"] == 3.0
                and r.json()["segments"][0]["text"] == "fake transcript"
            ),
        ),
    ],
)
async def test_response_formats(client: httpx.AsyncClient, engine, fmt: str, check) -> None:
    data = {"model": "whisper-1", "response_format": fmt, "language": "ja"}
    r = await client.post(ASR, data=data, files=upload())
    assert r.status_code == 200, r.text
    assert check(r) and engine.transcripts == ["ja"]


async def test_language_is_detected_when_absent(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(ASR, data={"model": "fake-whisper"}, files=upload())
    assert r.status_code == 200 and engine.transcripts == ["auto"]


@pytest.mark.parametrize(
    ("data", "files", "status", "param"),
    [
        ({"model": "whisper-1"}, None, 422, "file"),
        ({"model": "tts-1"}, upload(), 404, "model"),
        ({"model": "whisper-1", "response_format": "xml"}, upload(), 422, "response_format"),
        ({"model": "whisper-1"}, {"file": ("x.wav", b"not audio" * 50, "audio/wav")}, 422, "file"),
        ({"model": "whisper-1"}, upload(31.0), 413, "file"),
    ],
)
async def test_bad_requests(client: httpx.AsyncClient, data, files, status: int, param: str) -> None:
    assert_openai_error(await client.post(ASR, data=data, files=files), status, param)


async def test_off_without_an_asr_model(engine) -> None:
    engine.asr_model = None
    async with client_for(build_api(engine, Limits(), api_key="")) as c:
        r = await c.post(ASR, data={"model": "whisper-1"}, files=upload())
        assert_openai_error(r, 501)
        r = await c.post("/v1/audio/speech", json={"input": "hi", "ref_audio": b64(wav_bytes(2.0))})
        assert_openai_error(r, 422, "ref_text")  # zero-shot needs a transcript and nobody can make it
        files = {"audio_sample": ("p.wav", wav_bytes(2.0), "audio/wav")}
        r = await c.post("/v1/audio/voices", data={"name": "Bea"}, files=files)
        assert_openai_error(r, 422, "ref_text")


async def test_speech_transcribes_a_zero_shot_prompt_without_ref_text(client: httpx.AsyncClient, engine):
    prompt = b64(wav_bytes(2.0))
    r = await client.post("/v1/audio/speech", json={"input": "hello", "ref_audio": prompt})
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert req.mode == Mode.ZERO_SHOT and req.prompt_text == "fake transcript"
    assert engine.transcripts == ["auto"]
    r = await client.post("/v1/audio/speech", json={"input": "x", "ref_audio": prompt, "ref_text": "mine"})
    assert engine.requests[-1].prompt_text == "mine" and len(engine.transcripts) == 1  # given: not redone


async def test_a_saved_voice_without_ref_text_is_transcribed(client: httpx.AsyncClient, engine) -> None:
    files = {"audio_sample": ("p.wav", wav_bytes(2.0), "audio/wav")}
    r = await client.post("/v1/audio/voices", data={"name": "Bea"}, files=files)
    assert r.status_code == 201, r.text
    assert r.json()["prompt_text"] == "fake transcript"
