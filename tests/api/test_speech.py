"""POST /v1/audio/speech through httpx's ASGI transport: request mapping, every response mode and
format, every error as OpenAI JSON, limits checked before decoding, cleanup on client disconnect."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from typing import Any

import av
import httpx
import numpy as np
import pytest
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

from api.app import build_api
from api.streaming import StreamCut
from engine.config import Limits
from engine.errors import Busy, InvalidInput, NotFound, NotReady, SynthesisFailed, TooLarge
from engine.request import Mode
from tests.api.support import (
    RecordingEngine,
    assert_openai_error,
    b64,
    client_for,
    expected_samples,
    wait_until,
    wav_bytes,
)
from tests.conftest import WAIT_S

SPEECH = "/v1/audio/speech"


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "input": "hello there", "voice": "alice", **kw}


@pytest.fixture(autouse=True)
def alice(engine: RecordingEngine) -> None:
    engine.add_voice("alice", "unused.wav", "the prompt transcript")


def metric_value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def decode_av(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)]), stream.rate


# ------------------------------------------------------------------------------------------- success


async def test_whole_wav_has_exact_length_and_metric_headers(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(SPEECH, json=body(stream=False))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    x, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    assert sr == engine.sample_rate and len(x) == expected_samples(engine)
    assert int(r.headers["content-length"]) == len(r.content)
    for header in ("x-request-id", "x-ttfa-ms", "x-rtf", "x-audio-seconds", "x-seed"):
        assert header in r.headers, header
    assert float(r.headers["x-audio-seconds"]) == pytest.approx(engine.n_chunks * engine.chunk_s)
    assert float(r.headers["x-rtf"]) >= 0
    # the fake's 220 Hz sine comes back sample for sample (16-bit quantization only)
    t = np.arange(len(x)) / sr
    assert np.max(np.abs(x - 0.3 * np.sin(2 * np.pi * 220 * t))) < 1e-3


async def test_default_is_a_chunked_stream_with_ttfa_header(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(SPEECH, json=body())
    assert r.status_code == 200
    assert "x-ttfa-ms" in r.headers and "x-rtf" not in r.headers  # RTF is unknown when headers leave
    assert "content-length" not in r.headers
    x, _ = sf.read(io.BytesIO(r.content))
    assert len(x) == expected_samples(engine)


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus", "aac", "pcm"])
@pytest.mark.parametrize("stream", [False, True])
async def test_every_format_decodes(client: httpx.AsyncClient, engine, fmt: str, stream: bool) -> None:
    """wav and whole flac via soundfile; pcm via numpy; mp3, opus, aac and streamed flac via PyAV."""
    r = await client.post(SPEECH, json=body(response_format=fmt, stream=stream))
    assert r.status_code == 200, r.text
    seconds = engine.n_chunks * engine.chunk_s
    if fmt == "pcm":
        assert r.headers["x-sample-rate"] == "24000"
        assert len(r.content) == 2 * expected_samples(engine)
        return
    if fmt == "wav" or (fmt == "flac" and not stream):
        x, sr = sf.read(io.BytesIO(r.content))
        assert len(x) == expected_samples(engine) and sr == engine.sample_rate
        return
    x, sr = decode_av(r.content)
    assert seconds <= len(x) / sr <= seconds + 0.12


async def test_request_fields_reach_the_engine(client: httpx.AsyncClient, engine) -> None:
    extra = dict(instructions="speak slowly", language="en", seed=42, speed=1.5)
    r = await client.post(SPEECH, json=body(**extra))
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert (req.mode, req.instruct_text, req.language, req.seed, req.speed) == (
        Mode.INSTRUCT,
        "speak slowly",
        "en",
        42,
        1.5,
    )
    assert req.voice_id == "alice" and req.text == "hello there" and req.stream
    assert r.headers["x-request-id"] == req.request_id


@pytest.mark.parametrize("data_url", [False, True])
async def test_ref_audio_takes_precedence_over_voice(
    client: httpx.AsyncClient, engine, data_url: bool
) -> None:
    encoded = b64(wav_bytes(2.0, 16000))
    ref = f"data:audio/wav;base64,{encoded}" if data_url else encoded
    r = await client.post(SPEECH, json=body(ref_audio=ref, ref_text="a transcript"))
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert req.voice_id is None and req.prompt_text == "a transcript" and req.mode == Mode.ZERO_SHOT
    samples, sr = req.prompt_audio
    assert sr == 16000 and len(samples) == 32000 and samples.dtype == np.float32


async def test_voice_object_form_and_openai_model_alias(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(SPEECH, json=body(model="tts-1", voice={"id": "alice"}))
    assert r.status_code == 200 and engine.requests[-1].voice_id == "alice"


async def test_vc_mode_takes_source_audio(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(SPEECH, json=body(input="", source_audio=b64(wav_bytes(1.5, 16000))))
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert req.mode == Mode.VC and req.source_audio is not None and len(req.source_audio[0]) == 24000


async def test_sse_deltas_rebuild_the_file_and_done_has_metrics(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(SPEECH, json=body(stream_format="sse"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert len(events) - 1 >= engine.n_chunks  # one delta per chunk at least
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    x, _ = sf.read(io.BytesIO(audio))
    assert len(x) == expected_samples(engine)
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    assert done["metrics"]["rtf"] is not None and done["metrics"]["ttfa_ms"] is not None
    assert done["metrics"]["audio_s"] == pytest.approx(engine.n_chunks * engine.chunk_s)
    parts = done["metrics"]["ttfa_parts_ms"]
    assert list(parts) == ["queue", "frontend", "lm", "t2w_wait", "t2w_compute"]
    assert sum(parts.values()) == pytest.approx(done["metrics"]["ttfa_ms"])
    assert done["usage"]["output_tokens"] == engine.n_chunks * 5  # fake: 25 tokens/s x 0.2 s per chunk


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("patch", "status", "param"),
    [
        (dict(voice="bob"), 404, "voice"),  # engine NotFound
        (dict(input="   "), 422, "input"),
        (dict(speed=4.5), 422, "speed"),
        (dict(seed=-1), 422, "seed"),
        (dict(response_format="ogg"), 422, "response_format"),
        (dict(stream_format="websocket"), 422, "stream_format"),
        (dict(mode="karaoke"), 422, "mode"),
        (dict(model="gpt-4o"), 404, "model"),
        (dict(ref_audio="not base64!!", ref_text="t"), 400, "ref_audio"),
        (dict(ref_audio="data:audio/wav,plain", ref_text="t"), 400, "ref_audio"),
        (dict(ref_audio="https://example.com/a.wav", ref_text="t"), 400, "ref_audio"),
        (dict(ref_audio=b64(b"definitely not audio" * 10), ref_text="t"), 422, "ref_audio"),
        (dict(ref_audio=b64(wav_bytes(0.5)), ref_text="t"), 422, "ref_audio"),  # shorter than 1 s
        (dict(ref_audio=b64(wav_bytes(2.0, silent=True)), ref_text="t"), 422, "ref_audio"),
        (dict(ref_audio=b64(wav_bytes(31.0)), ref_text="t"), 413, "ref_audio"),  # longer than 30 s
        (dict(mode="vc", input=""), 422, "source_audio"),
        (dict(mode="instruct"), 422, "instructions"),
        (dict(input="x" * 2001), 413, "input"),
    ],
)
async def test_bad_requests(
    client: httpx.AsyncClient, engine, patch: dict, status: int, param: str | None
) -> None:
    r = await client.post(SPEECH, json=body(**patch))
    assert_openai_error(r, status, param)


async def test_missing_input_and_bad_json(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.post(SPEECH, json={"voice": "alice"}), 422, "input")
    bad = await client.post(SPEECH, content=b"{nope", headers={"content-type": "application/json"})
    assert assert_openai_error(bad, 400)["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (Busy("queue is full", retry_after_s=2.5), 429, "3"),
        (NotReady("warming up", retry_after_s=10), 503, "10"),
        (TooLarge("prompt too long"), 413, None),
        (NotFound("no voice"), 404, None),
        (InvalidInput("bad mode for this model"), 422, None),
        (SynthesisFailed("non-finite audio"), 500, None),
    ],
)
async def test_engine_errors_map_to_status(error: Exception, status: int, retry_after: str | None) -> None:
    engine = RecordingEngine(fail_first=error)
    engine.add_voice("alice", "x", "t")
    async with client_for(build_api(engine, api_key="")) as c:
        r = await c.post(SPEECH, json=body())
    err = assert_openai_error(r, status)
    assert err["message"] == str(error)
    assert r.headers.get("retry-after") == retry_after


async def test_unexpected_exception_is_a_500_without_internals(caplog) -> None:
    engine = RecordingEngine(fail_first=RuntimeError("secret internal detail"))
    engine.add_voice("alice", "x", "t")
    async with client_for(build_api(engine, api_key="")) as c:
        r = await c.post(SPEECH, json=body())
    assert assert_openai_error(r, 500)["type"] == "server_error"
    assert "secret internal detail" not in r.text
    assert "secret internal detail" in caplog.text  # ... but the server log has it


async def test_not_ready_engine_is_a_503(engine) -> None:
    engine.ready = False
    async with client_for(build_api(engine, api_key="")) as c:
        r = await c.post(SPEECH, json=body())
    assert_openai_error(r, 503)
    assert int(r.headers["retry-after"]) >= 1 and engine.requests == []


async def test_oversize_base64_refused_before_decoding(engine, monkeypatch) -> None:
    def must_not_decode(*args: Any, **kw: Any) -> bytes:
        raise AssertionError("decoded an oversize payload")

    monkeypatch.setattr(base64, "b64decode", must_not_decode)
    limits = Limits(max_upload_bytes=3000)
    async with client_for(build_api(engine, limits, api_key="")) as c:
        r = await c.post(SPEECH, json=body(ref_audio="A" * 4004, ref_text="t"))
    assert assert_openai_error(r, 413, "ref_audio")["code"] == "upload_too_large"


async def test_chunked_body_over_the_cap_is_cut(engine) -> None:
    limits = Limits(max_upload_bytes=1000, max_text_chars=10)

    async def endless() -> Any:
        yield b'{"input": "'
        for _ in range(200):
            yield b"x" * 1024

    async with client_for(build_api(engine, limits, api_key="")) as c:
        r = await c.post(SPEECH, content=endless(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert assert_openai_error(r, 413)["code"] == "body_too_large"


def http_scope(path: str, body: bytes, content_length: int | None = None) -> dict[str, Any]:
    length = len(body) if content_length is None else content_length
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(length).encode())],
        "client": ("127.0.0.1", 1234),
        "server": ("api.test", 80),
    }


async def test_declared_oversize_body_is_refused_unread(engine) -> None:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    app = build_api(engine, api_key="")
    await app(http_scope(SPEECH, b"", content_length=10**9), receive, send)
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "body_too_large"


# ------------------------------------------------------------------------------ mid-stream and disconnect


async def test_sse_mid_stream_failure_is_an_error_event() -> None:
    engine = RecordingEngine(fail_after=SynthesisFailed("device out of memory"))
    engine.add_voice("alice", "x", "t")
    async with client_for(build_api(engine, api_key="")) as c:
        r = await c.post(SPEECH, json=body(stream_format="sse"))
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and events[-1]["error"]["message"] == "device out of memory"


async def test_audio_mid_stream_failure_cuts_the_response(caplog: pytest.LogCaptureFixture) -> None:
    """After the headers a clean end would pass truncated audio off as complete: the server must fail it."""
    engine = RecordingEngine(fail_after=SynthesisFailed("device out of memory"))
    engine.add_voice("alice", "x", "t")
    app = build_api(engine, api_key="")
    async with client_for(app) as c:
        with pytest.raises(StreamCut) as cut:
            await c.post(SPEECH, json=body())
    assert isinstance(cut.value.__cause__, SynthesisFailed)
    metrics = app.state.cosystream_api.telemetry.exposition().decode()
    assert metric_value(metrics, "cosystream_stream_errors_total") == 1
    assert engine.active == {}
    failed = [r for r in caplog.records if "mid-stream" in r.getMessage()]  # one line, as SSE logs it
    assert [(r.levelname, r.exc_info) for r in failed] == [("WARNING", None)]
    assert "failed mid-stream: device out of memory" in failed[0].getMessage()


async def test_a_stream_the_server_ends_is_cut_with_one_line_and_no_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Shutting down (or the engine stopped) is the server's own choice: logged as one warning line."""
    engine = RecordingEngine(fail_after=NotReady("the server is shutting down"))
    engine.add_voice("alice", "x", "t")
    async with client_for(build_api(engine, api_key="")) as c:
        with pytest.raises(StreamCut):
            await c.post(SPEECH, json=body())
    ended = [r for r in caplog.records if "mid-stream" in r.getMessage()]
    assert [(r.levelname, r.exc_info) for r in ended] == [("WARNING", None)]
    assert "ended mid-stream: the server is shutting down" in ended[0].getMessage()


async def run_until_disconnect(app: Any, payload: dict[str, Any], after_body_bytes: bool) -> list[dict]:
    """Drive the app as a server would, with a client that leaves after the first audio bytes (or at once)."""
    raw = json.dumps(payload).encode()
    got_audio, sent, delivered = asyncio.Event(), [], False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if after_body_bytes:
            await got_audio.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            got_audio.set()

    await asyncio.wait_for(app(http_scope(SPEECH, raw), receive, send), timeout=WAIT_S)
    return sent


@pytest.mark.parametrize("sse", [False, True])
async def test_disconnect_mid_stream_aborts_and_closes_the_engine_stream(sse: bool) -> None:
    engine = RecordingEngine(n_chunks=50, chunk_s=0.2, delay_s=0.02)  # 1 s of work: cannot finish first
    engine.add_voice("alice", "x", "t")
    app = build_api(engine, api_key="")
    sent = await run_until_disconnect(
        app, body(stream_format="sse" if sse else "audio"), after_body_bytes=True
    )
    req = engine.requests[-1]
    assert sent[0]["status"] == 200
    assert engine.active == {}, "the engine stream's finally did not run"
    assert engine.aborted == [req.request_id] and engine.completed == 0
    metrics = app.state.cosystream_api.telemetry.exposition().decode()
    assert metric_value(metrics, "cosystream_client_disconnects_total") == 1
    assert metric_value(metrics, "cosystream_api_streams_active") == 0


async def test_send_failing_after_disconnect_closes_the_suspended_generator() -> None:
    """ASGI 2.4 servers report a gone client by raising OSError from send(): the body generator is then
    suspended at a ``yield`` and only an explicit close reaches the engine stream's ``finally``."""
    engine = RecordingEngine(n_chunks=50, chunk_s=0.2, delay_s=0.02)
    engine.add_voice("alice", "x", "t")
    raw = json.dumps(body()).encode()
    scope = http_scope(SPEECH, raw) | {"asgi": {"version": "3.0", "spec_version": "2.4"}}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)  # this server never reports the disconnect through receive()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            raise OSError("connection reset by peer")

    await asyncio.wait_for(build_api(engine, api_key="")(scope, receive, send), timeout=WAIT_S)
    assert engine.active == {} and engine.aborted == [engine.requests[-1].request_id]


async def test_disconnect_during_whole_file_synthesis_aborts() -> None:
    engine = RecordingEngine(n_chunks=50, chunk_s=0.2, delay_s=0.02)
    engine.add_voice("alice", "x", "t")
    app = build_api(engine, api_key="")
    sent = await run_until_disconnect(app, body(stream=False), after_body_bytes=False)
    assert sent[0]["status"] == 499
    assert engine.active == {} and engine.aborted == [engine.requests[-1].request_id]


async def test_complete_stream_is_not_aborted(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(SPEECH, json=body())
    assert r.status_code == 200 and engine.aborted == [] and engine.completed == 1 and engine.active == {}


async def test_a_whole_wav_carries_its_true_sizes(client: httpx.AsyncClient, engine) -> None:
    """``stream: false``: RIFF and data sizes are exact, so ``wave`` reads the right frame count (a streamed
    wav cannot know them when its header leaves: 0xFFFFFFFF there means "read to the end")."""
    data = (await client.post(SPEECH, json=body(stream=False))).content
    n = expected_samples(engine)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnframes(), w.getframerate(), w.getsampwidth()) == (n, 24000, 2)
    assert int.from_bytes(data[4:8], "little") == len(data) - 8
    streamed = (await client.post(SPEECH, json=body(stream=True))).content
    assert streamed[4:8] == streamed[40:44] == b"\xff\xff\xff\xff" and len(streamed) == len(data)


async def test_a_streamed_flac_says_its_length_is_unknown(client: httpx.AsyncClient, engine) -> None:
    """FLAC's STREAMINFO leaves the stream before the audio is known: total samples 0 is the format's
    "unknown" (libsndfile then reports a huge frame count); decoders read every sample. A whole flac (the
    default) carries the exact count."""
    streamed = (await client.post(SPEECH, json=body(response_format="flac", stream=True))).content
    whole = (await client.post(SPEECH, json=body(response_format="flac"))).content
    n = expected_samples(engine)
    for data, total in ((streamed, 0), (whole, n)):
        # "fLaC", a 4-byte block header, then the 34-byte STREAMINFO, which ends with the total samples
        # (36 bits) and the MD5 (128 bits)
        info = int.from_bytes(data[8:42], "big")
        assert info >> 128 & (2**36 - 1) == total
        assert len(decode_av(data)[0]) == n


@pytest.mark.parametrize("allowed", [False, True], ids=["public", "bench"])
async def test_forced_tokens_reach_the_engine_only_where_the_server_allows_them(
    engine, allowed: bool
) -> None:
    """A benchmarking extension: a public server ignores it (a short text may not ask for minutes)."""
    async with client_for(build_api(engine, Limits(forced_tokens=allowed), api_key="")) as client:
        r = await client.post(SPEECH, json=body(forced_tokens=250))
    assert r.status_code == 200, r.text
    assert engine.requests[-1].forced_tokens == (250 if allowed else None)


def test_the_api_decodes_a_prompt_ahead_as_it_is_built(monkeypatch) -> None:
    """Building the speech routes decodes a short WAV through the prompts' own decoder on a thread, so the
    first request's prompt is not the decoder's first (libsndfile's load)."""
    import engine.audio

    decoded: list[engine.audio.Audio] = []
    real = engine.audio.read_audio
    monkeypatch.setattr(engine.audio, "read_audio", lambda data, *a: decoded.append(real(data, *a)))
    build_api(RecordingEngine())
    assert wait_until(lambda: len(decoded) == 1)
    assert decoded[0].sample_rate == 24000 and decoded[0].samples.size == 2400
