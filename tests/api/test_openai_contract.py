"""Every route through the stock ``openai`` client against a live uvicorn on 127.0.0.1: the client builds the
requests as it builds them for OpenAI, and every answer parses into an object whose required fields are all
there (not merely a 200). Errors arrive as the client's exceptions with ``code`` set and ``param`` naming
the field at fault."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import soundfile as sf
from openai.types import Model
from openai.types.audio import Transcription, TranscriptionVerbose, Voice, VoiceDeleted

from api.app import build_api
from tests.api.support import RecordingEngine, live_server, speech_like

KEY = "sk-contract"


@pytest.fixture(scope="module")
def engine() -> RecordingEngine:
    engine = RecordingEngine(n_chunks=3, chunk_s=0.2, delay_s=0.0)
    engine.add_voice("Amy", "unused.wav", "a public voice", None)
    return engine


@pytest.fixture(scope="module")
def client(engine: RecordingEngine) -> Iterator[openai.OpenAI]:
    with (
        live_server(build_api(engine, api_key=KEY)) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as c,
    ):
        yield c


def populated(obj: Any) -> Any:
    """``obj`` with every field its OpenAI type requires present and not None."""
    missing = [
        name
        for name, spec in type(obj).model_fields.items()
        if spec.is_required() and getattr(obj, name, None) is None
    ]
    assert not missing, f"{type(obj).__name__} lacks {missing}"
    return obj


def wav(seconds: float, sr: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, speech_like(seconds, sr), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def error_of(caught: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    body = caught.value.body
    assert isinstance(body, dict) and caught.value.code, body  # the client reads code from the body
    assert set(body) == {"message", "type", "param", "code"}
    return body


# ------------------------------------------------------------------------------------------- voices


def test_voice_create_use_and_delete(client: openai.OpenAI, engine: RecordingEngine) -> None:
    voice = client.audio.voices.create(
        name="Ada", audio_sample=("ada.wav", wav(3.0, 24000), "audio/wav"), consent="cons_1234"
    )
    assert isinstance(populated(voice), Voice)
    assert (voice.id, voice.name, voice.object, voice.type) == ("ada", "Ada", "audio.voice", "audio_sample")
    assert voice.created_at > 0 and engine.voice_calls[-1]["consent"] == "cons_1234"
    extra = voice.model_extra or {}
    assert extra["consent"] == "cons_1234" and extra["public"] is False and extra["duration_s"] > 0

    audio = client.audio.speech.create(model="tts-1", voice=voice.id, input="hello", response_format="wav")
    assert sf.read(io.BytesIO(audio.content))[0].size > 0 and engine.requests[-1].voice_id == "ada"

    listing = client.get("/audio/voices", cast_to=object)
    shown = {v["id"]: v for v in listing["data"]}  # type: ignore[index]
    assert shown["ada"]["consent"] == "cons_1234" and shown["ada"]["object"] == "audio.voice"

    deleted = client.audio.voices.delete(voice.id)
    assert isinstance(populated(deleted), VoiceDeleted) and deleted.deleted and deleted.id == "ada"


def test_voice_name_taken_is_a_409(client: openai.OpenAI) -> None:
    sample = ("b.wav", wav(3.0, 24000), "audio/wav")
    client.audio.voices.create(name="Bea", audio_sample=sample, consent="cons_1")
    with pytest.raises(openai.ConflictError) as caught:
        client.audio.voices.create(name="BEA", audio_sample=sample, consent="cons_2")
    error = error_of(caught)
    assert (error["code"], error["param"]) == ("name_taken", "name") and "'Bea'" in error["message"]


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        (dict(name="x" * 65), "name", "invalid_name"),
        (dict(consent="c" * 300), "consent", "invalid_value"),
        (dict(extra_body={"type": "prompt", "prompt": "a calm voice"}), "type", "unsupported_voice_type"),
        (dict(extra_body={"type": "clone"}), "type", "invalid_value"),
        (dict(extra_body={"ref_text": "t" * 5000}), "ref_text", "text_too_long"),
        (dict(audio_sample=("x.wav", wav(3.0, 8000), "audio/wav")), "audio_sample", "invalid_input"),
    ],
)
def test_voice_form_fields_are_checked(client: openai.OpenAI, kwargs: dict, param: str, code: str) -> None:
    args = dict(name="Cy", audio_sample=("c.wav", wav(3.0, 24000), "audio/wav"), consent="cons_1") | kwargs
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.voices.create(**args)
    error = error_of(caught)
    assert (error["param"], error["code"]) == (param, code), error


# ------------------------------------------------------------------------------------------- models


def test_models_list_every_accepted_id_and_retrieve_echoes_it(client: openai.OpenAI) -> None:
    models = [populated(m) for m in client.models.list()]
    ids = [m.id for m in models]
    for name in ("fake", "tts-1", "tts-1-hd", "gpt-4o-mini-tts", "whisper-1", "fake-whisper"):
        assert name in ids
        got = client.models.retrieve(name)
        assert isinstance(populated(got), Model) and got.id == name and got.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-5")
    assert error_of(caught)["code"] == "model_not_found"


def test_every_listed_model_is_accepted_by_its_route(client: openai.OpenAI) -> None:
    for model in client.models.list():
        kind = (model.model_extra or {})["kind"]
        if kind == "speech":
            assert client.audio.speech.create(model=model.id, voice="amy", input="hi").content
        else:
            got = client.audio.transcriptions.create(model=model.id, file=("a.wav", wav(1.0, 16000)))
            assert got.text == "fake transcript"


# ------------------------------------------------------------------------------------------- speech


def test_sse_usage_counts_input_and_output_tokens(client: openai.OpenAI) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="amy", input="héllo", stream_format="sse"
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    usage = events[-1]["usage"]
    assert events[-1]["type"] == "speech.audio.done"
    assert usage["input_tokens"] == len("héllo".encode())  # the fake engine's tokens are UTF-8 bytes
    assert (
        usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"speed": True}, "speed"),
        ({"stream": "yes"}, "stream"),
        ({"seed": True}, "seed"),
        ({"speed": "1"}, "speed"),
    ],
)
def test_booleans_and_strings_are_not_numbers(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.audio.speech.create(model="tts-1", voice="amy", input="hi", extra_body=extra)
    error = error_of(caught)
    assert (error["param"], error["code"]) == (param, "invalid_value")


def test_invalid_utf8_json_is_invalid_json(client: openai.OpenAI) -> None:
    """No stock client sends it, so plain httpx does: the answer is the same error shape."""
    body = b'{"input": "h\xff\xfe", "voice": "amy"}'
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{client.base_url}audio/speech", content=body, headers=headers, timeout=20)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


# ------------------------------------------------------------------------------------------- transcription


def test_transcription_of_short_telephone_audio(client: openai.OpenAI, engine: RecordingEngine) -> None:
    phone = ("call.wav", wav(0.4, 8000), "audio/wav")  # 8 kHz, 0.4 s: a voice prompt could be neither
    got = client.audio.transcriptions.create(model="whisper-1", file=phone)
    assert isinstance(populated(got), Transcription) and got.text == "fake transcript"
    assert got.usage is not None and got.usage.type == "duration"

    verbose = client.audio.transcriptions.create(
        model="whisper-1",
        file=phone,
        response_format="verbose_json",
        language="en",
        prompt="a phone call",
        temperature=0.0,
        timestamp_granularities=["segment"],
    )
    assert isinstance(populated(verbose), TranscriptionVerbose) and verbose.language == "english"
    assert verbose.segments and populated(verbose.segments[0]).text == "fake transcript"
    assert verbose.segments[0].compression_ratio > 0 and engine.transcripts[-1] == "en"

    text = client.audio.transcriptions.create(model="whisper-1", file=phone, response_format="text")
    assert text == "fake transcript"
    srt = client.audio.transcriptions.create(model="whisper-1", file=phone, response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ") and "fake transcript" in srt
    vtt = client.audio.transcriptions.create(model="whisper-1", file=phone, response_format="vtt")
    assert vtt.startswith("WEBVTT") and "fake transcript" in vtt


@pytest.mark.parametrize(
    ("kwargs", "status", "param", "code"),
    [
        (dict(temperature=1.5), 422, "temperature", "invalid_value"),
        (dict(extra_body={"temperature": "warm"}), 422, "temperature", "invalid_value"),
        (dict(response_format="xml"), 422, "response_format", "invalid_value"),
        (
            dict(timestamp_granularities=["word"], response_format="verbose_json"),
            422,
            "timestamp_granularities",
            "unsupported_value",
        ),
        (dict(language="english!"), 422, "language", "invalid_value"),
        (dict(model="tts-1"), 404, "model", "model_not_found"),
        (dict(file=("x.wav", b"not audio" * 40, "audio/wav")), 422, "file", "invalid_input"),
        (dict(file=("long.wav", wav(31.0, 8000), "audio/wav")), 413, "file", "too_large"),
        (dict(file=("low.wav", wav(1.0, 2000), "audio/wav")), 422, "file", "invalid_input"),
    ],
)
def test_transcription_fields_are_checked(
    client: openai.OpenAI, kwargs: dict, status: int, param: str, code: str
) -> None:
    args = dict(model="whisper-1", file=("a.wav", wav(1.0, 16000), "audio/wav")) | kwargs
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.transcriptions.create(**args)
    assert caught.value.status_code == status
    error = error_of(caught)
    assert (error["param"], error["code"]) == (param, code), error


def test_short_clip_and_low_rate_message_is_transcription_s_own(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.audio.transcriptions.create(model="whisper-1", file=("low.wav", wav(1.0, 2000), "audio/wav"))
    message = error_of(caught)["message"]
    assert "transcription needs at least 4000 Hz" in message and "CosyVoice" not in message
