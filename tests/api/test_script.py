"""POST /v1/audio/script: a two-voice script as a file, as JSON with word times, as SSE, and its errors."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from api.app import build_api
from engine.config import Limits
from engine.request import Mode
from tests.api.support import RecordingEngine, assert_openai_error, expected_samples, live_server, wav_bytes

SCRIPT = 'Alice: Hello Bob. <break time="250ms"/> Nice day.\nBob (cheerful): Hi Alice!'


@pytest.fixture
def voices(engine, tmp_path):
    wav = tmp_path / "v.wav"
    wav.write_bytes(wav_bytes(3.0))
    return {name: engine.add_voice(name, str(wav), "A prompt.", None).id for name in ("Alice", "Bob")}


def body(voices, **kw):
    return {"script": SCRIPT, "voices": voices, "gap_ms": 400} | kw


async def test_whole_file_holds_every_part_and_pause_to_the_sample(client, engine, voices):
    r = await client.post("/v1/audio/script", json=body(voices))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    audio, rate = sf.read(io.BytesIO(r.content), dtype="float32")
    part = expected_samples(engine)
    assert rate == 24000 and audio.size == 3 * part + round(0.25 * rate) + round(0.4 * rate)
    assert [(q.text, q.voice_id, q.mode, q.instruct_text) for q in engine.requests] == [
        ("Hello Bob.", voices["Alice"], Mode.ZERO_SHOT, ""),
        ("Nice day.", voices["Alice"], Mode.ZERO_SHOT, ""),
        ("Hi Alice!", voices["Bob"], Mode.INSTRUCT, "cheerful"),
    ]
    gap = audio[part : part + round(0.25 * rate)]
    assert not gap.any() and np.abs(audio[part - 50 : part]).max() > 0


async def test_timestamps_come_as_json_with_parts_words_and_subtitles(client, voices):
    r = await client.post("/v1/audio/script", json=body(voices, timestamps=True))
    assert r.status_code == 200, r.text
    out = r.json()
    audio, rate = sf.read(io.BytesIO(base64.b64decode(out["audio"])), dtype="float32")
    assert out["duration_s"] == pytest.approx(audio.size / rate)
    parts = out["parts"]
    assert [(p["speaker"], p["text"], p["index"], p["total"]) for p in parts] == [
        ("Alice", "Hello Bob.", 0, 3),
        ("Alice", "Nice day.", 1, 3),
        ("Bob", "Hi Alice!", 2, 3),
    ]
    assert parts[1]["start_s"] - parts[0]["end_s"] == pytest.approx(0.25)
    assert parts[2]["start_s"] - parts[1]["end_s"] == pytest.approx(0.4)
    assert [w["text"] for w in out["words"]] == ["Hello", "Bob.", "Nice", "day.", "Hi", "Alice!"]
    for p in parts:
        for w in p["words"]:
            assert p["start_s"] <= w["start_s"] < w["end_s"] <= p["end_s"] + 1e-6
    assert out["srt"].startswith("1\n00:00:00,") and out["vtt"].startswith("WEBVTT\n")


async def test_sse_interleaves_audio_and_part_events(client, voices):
    r = await client.post("/v1/audio/script", json=body(voices, stream_format="sse", response_format="pcm"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "speech.audio.delta" and kinds[-1] == "speech.audio.done"
    done = [e for e in events if e["type"] == "script.part.done"]
    assert [d["speaker"] for d in done] == ["Alice", "Alice", "Bob"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(pcm) // 2 == round(done[-1]["end_s"] * 24000)
    # each part's event comes after its audio: the audio before it reaches its end
    first = kinds.index("script.part.done")
    before = b"".join(
        base64.b64decode(e["audio"]) for e in events[:first] if e["type"] == "speech.audio.delta"
    )
    assert len(before) // 2 == round(done[0]["end_s"] * 24000)


async def test_streamed_bytes_are_the_whole_file(client, voices):
    whole = await client.post("/v1/audio/script", json=body(voices, response_format="pcm"))
    streamed = await client.post("/v1/audio/script", json=body(voices, response_format="pcm", stream=True))
    assert streamed.status_code == 200 and streamed.content == whole.content


@pytest.mark.parametrize(
    ("change", "status", "param", "match"),
    [
        ({"script": "Alice: a <b>bold</b> move"}, 422, "script", "unknown tag '<b>'"),
        ({"script": 'Alice: wait <break time="30s"/>'}, 422, "script", "over the limit of 10 s"),
        ({"script": "Carol (angry): hi"}, 422, "voices", "speaker 'Carol' has no voice"),
        ({"script": "x" * 20001}, 413, "script", "the limit is 20000"),
        ({"voices": {"Alice": "nobody", "Bob": "alloy"}}, 404, "voices", "no voice 'nobody'"),
        ({"gap_ms": 9000}, 422, "gap_ms", None),
    ],
)
async def test_bad_scripts_get_clear_errors(client, voices, change, status, param, match):
    r = await client.post("/v1/audio/script", json=body(voices) | change)
    error = assert_openai_error(r, status, param)
    if match:
        assert match in error["message"]


async def test_a_20000_character_text_streams_from_its_first_sentence(tmp_path):
    engine = RecordingEngine(n_chunks=2, chunk_s=0.2, delay_s=0.02)  # ~40 ms of compute per sentence
    wav = tmp_path / "v.wav"
    wav.write_bytes(wav_bytes(3.0))
    voice = engine.add_voice("Narrator", str(wav), "A prompt.", None).id
    sentence = "This long text goes on, sentence after sentence, for a while. "
    text = (sentence * (20000 // len(sentence) + 1))[:20000]
    request = {"script": text, "voices": {"Narrator": voice}, "stream": True, "response_format": "pcm"}
    with live_server(build_api(engine, Limits(), api_key="")) as url:
        client = httpx.AsyncClient(base_url=url, timeout=120)
        async with client, client.stream("POST", "/v1/audio/script", json=request) as r:
            assert r.status_code == 200
            total = int(r.headers["X-Script-Parts"])
            received, asked_at_first_byte = 0, None
            async for data in r.aiter_bytes():
                if asked_at_first_byte is None and data:
                    asked_at_first_byte = len(engine.requests)
                received += len(data)
    assert total > 60 and asked_at_first_byte is not None and asked_at_first_byte <= 3  # look-ahead 1
    assert len(engine.requests) == total and received // 2 == total * expected_samples(engine)
    assert all(q.voice_id == voice and len(q.text) <= 230 for q in engine.requests)


async def test_word_times_come_from_the_engines_word_timer(tmp_path):
    """The route asks the engine's ``word_timer`` (a local engine's Whisper): its times, not the spread."""
    from engine.serving.subtitles import Word

    class Timer:
        def words(self, pcm, sample_rate, language=None):
            return [Word("Hello", 0.1, 0.2), Word("Bob.", 0.3, 0.4)]

    engine = RecordingEngine()
    engine.word_timer = Timer()  # type: ignore[attr-defined]
    wav = tmp_path / "v.wav"
    wav.write_bytes(wav_bytes(3.0))
    voice = engine.add_voice("Alice", str(wav), "A prompt.", None).id
    script = {"script": "Alice: Hello Bob.", "voices": {"Alice": voice}, "timestamps": True}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_api(engine, Limits(), api_key="")), base_url="http://t"
    ) as client:
        r = await client.post("/v1/audio/script", json=script)
    assert r.status_code == 200, r.text
    assert [(w["text"], w["start_s"], w["end_s"]) for w in r.json()["words"]] == [
        ("Hello", 0.1, 0.2), ("Bob.", 0.3, 0.4),
    ]  # fmt: skip
