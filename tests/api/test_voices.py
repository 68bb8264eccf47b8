"""/v1/audio/voices: multipart upload creates a saved voice the speech route can use; list, get, delete;
bad uploads are OpenAI-style 4xx before the engine sees them."""

from __future__ import annotations

import os

import httpx
import pytest

from api.app import build_api
from engine.config import Limits
from tests.api.support import RecordingEngine, assert_openai_error, client_for, wav_bytes

VOICES = "/v1/audio/voices"


def upload(
    client: httpx.AsyncClient,
    name: str = "alice",
    text: str = "hello world",
    data: bytes | None = None,
    field="audio_sample",
):
    files = {field: ("alice.wav", wav_bytes(2.0) if data is None else data, "audio/wav")}
    return client.post(VOICES, data={"name": name, "ref_text": text}, files=files)


async def test_create_list_get_use_delete(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
    data = wav_bytes(2.0)
    r = await upload(client, data=data)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["object"] == "audio.voice" and created["type"] == "audio_sample"
    assert created["id"] == "alice" and created["name"] == "alice" and created["prompt_text"] == "hello world"
    assert created["created_at"] > 0 and created["duration_s"] > 0 and created["public"] is False
    assert created["example"] is False and created["consent"] == ""

    call = engine.voice_calls[-1]
    assert (call["name"], call["text"], call["data"]) == (
        "alice",
        "hello world",
        data,
    )  # file existed, intact
    assert call["path"].endswith(".wav") and not os.path.exists(call["path"])  # and is gone afterwards

    listing = (await client.get(VOICES)).json()
    assert listing["object"] == "list" and listing["voices"] == ["alice"]
    assert [v["id"] for v in listing["data"]] == ["alice"]
    assert (await client.get(f"{VOICES}/alice")).json()["name"] == "alice"

    speech = await client.post("/v1/audio/speech", json={"model": "fake", "input": "hi", "voice": "alice"})
    assert speech.status_code == 200 and engine.requests[-1].voice_id == "alice"

    deleted = await client.delete(f"{VOICES}/alice")
    assert deleted.status_code == 200
    assert deleted.json() == {"object": "audio.voice.deleted", "id": "alice", "deleted": True}
    assert (await client.get(VOICES)).json()["voices"] == []
    assert_openai_error(await client.delete(f"{VOICES}/alice"), 404)
    assert_openai_error(await client.get(f"{VOICES}/alice"), 404, "voice_id")


async def test_file_field_alias(client: httpx.AsyncClient) -> None:
    assert (await upload(client, field="file")).status_code == 201


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        (dict(name=" "), 422, "name"),
        (dict(name="n" * 65), 422, "name"),
        (dict(data=b"RIFF not really a wav file at all"), 422, "audio_sample"),
        (dict(data=wav_bytes(0.4)), 422, "audio_sample"),  # shorter than min_prompt_s
        (dict(data=wav_bytes(2.0, silent=True)), 422, "audio_sample"),
        (dict(data=wav_bytes(2.0, sr=8000)), 422, "audio_sample"),  # below 16 kHz
    ],
)
async def test_bad_uploads(client: httpx.AsyncClient, engine, kwargs: dict, status: int, param: str) -> None:
    assert_openai_error(await upload(client, **kwargs), status, param)
    assert engine.voice_calls == []


async def test_missing_file_and_missing_name(client: httpx.AsyncClient) -> None:
    r = await client.post(VOICES, data={"name": "a", "ref_text": "t"})
    assert_openai_error(r, 422, "audio_sample")
    r = await client.post(VOICES, data={"ref_text": "t"}, files={"file": ("a.wav", wav_bytes(), "audio/wav")})
    assert_openai_error(r, 422, "name")


async def test_upload_over_the_limit_is_413(engine) -> None:
    limits = Limits(max_upload_bytes=40_000)  # a 2 s 16 kHz 16-bit wav is 64 kB
    async with client_for(build_api(engine, limits, api_key="")) as c:
        r = await upload(c)
    assert_openai_error(r, 413)
    assert engine.voice_calls == []


async def test_engine_refusal_is_mapped(client: httpx.AsyncClient, engine, monkeypatch) -> None:
    from engine.errors import InvalidInput

    def refuse(name: str, path: str, text: str, owner: str | None, consent: str) -> None:
        raise InvalidInput("voice name 'alice' is taken")

    monkeypatch.setattr(engine, "add_voice", refuse)
    err = assert_openai_error(await upload(client), 422)
    assert err["message"] == "voice name 'alice' is taken"


def test_voice_records_of_any_shape() -> None:
    from api.schemas import VoiceInfo

    record = {"id": "v1", "name": "Ann", "prompt_text": "hi", "family": "cosyvoice2", "compatible": False}
    info = VoiceInfo.of(record)
    assert (info.id, info.name, info.family, info.compatible, info.created_at) == (
        "v1",
        "Ann",
        "cosyvoice2",
        False,
        0,
    )
    assert VoiceInfo.of(type("V", (), {"id": "v2", "created_at": 12.7})()).model_dump()["created_at"] == 12


async def test_voices_need_the_key_when_one_is_set(engine) -> None:
    async with client_for(build_api(engine, api_key="k3y")) as c:
        assert_openai_error(await c.get(VOICES), 401)
        assert (await c.get(VOICES, headers={"Authorization": "Bearer k3y"})).status_code == 200


async def test_each_api_key_is_its_own_voice_namespace(engine) -> None:
    """Two keys: neither lists, uses nor deletes the other's voice; public voices are read-only to both."""
    engine.add_voice("Shared", "p.wav", "public", None)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    files = {"audio_sample": ("p.wav", wav_bytes(2.0), "audio/wav")}
    async with client_for(build_api(engine, Limits(), api_key=["key-a", "key-b"])) as c:
        r = await c.post("/v1/audio/voices", data={"name": "Mine", "ref_text": "t"}, files=files, headers=a)
        assert r.status_code == 201, r.text
        voice_id = r.json()["id"]
        assert voice_id in (await c.get("/v1/audio/voices", headers=a)).json()["voices"]
        listed_b = (await c.get("/v1/audio/voices", headers=b)).json()["voices"]
        assert "shared" in listed_b and voice_id not in listed_b
        assert (await c.get(f"/v1/audio/voices/{voice_id}", headers=b)).status_code == 404
        speech = {"input": "hi", "voice": voice_id}
        assert (await c.post("/v1/audio/speech", json=speech, headers=b)).status_code == 404
        assert (await c.post("/v1/audio/speech", json=speech, headers=a)).status_code == 200
        assert (await c.delete(f"/v1/audio/voices/{voice_id}", headers=b)).status_code == 404
        assert_openai_error(await c.delete("/v1/audio/voices/shared", headers=a), 403)
        assert (await c.delete(f"/v1/audio/voices/{voice_id}", headers=a)).status_code == 200
        assert (await c.get("/v1/audio/voices", headers={"Authorization": "Bearer nope"})).status_code == 401


async def test_a_name_taken_in_a_race_is_a_409(client: httpx.AsyncClient, engine, monkeypatch) -> None:
    """The library's own check (the one that holds under concurrent saves) maps to the same 409."""
    from engine.errors import Conflict

    def clash(name: str, path: str, text: str, owner: str | None, consent: str) -> None:
        raise Conflict("your voice is already named 'alice' (id 'alice')", field="name")

    monkeypatch.setattr(engine, "add_voice", clash)
    err = assert_openai_error(await upload(client), 409, "name")
    assert err["code"] == "name_taken"
