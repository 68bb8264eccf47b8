"""The real ``openai`` client against a live uvicorn on 127.0.0.1 serving the API over a FakeEngine.

Formats are verified with: wav and flac -> soundfile, pcm -> numpy (s16le), mp3 / opus / aac -> PyAV.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

from api.app import build_api
from engine.errors import Busy
from tests.api.support import RecordingEngine, expected_samples, live_server, wait_until
from tests.conftest import WAIT_S

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def engine() -> RecordingEngine:
    engine = RecordingEngine(n_chunks=4, chunk_s=0.2, delay_s=0.0)
    engine.add_voice("alice", "unused.wav", "the prompt transcript")
    return engine


@pytest.fixture(scope="module")
def server(engine: RecordingEngine) -> Iterator[str]:
    with live_server(build_api(engine, api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(server: str, engine: RecordingEngine) -> Iterator[openai.OpenAI]:
    engine.delay_s, engine.n_chunks, engine.fail_first = 0.0, 4, None  # tests below change them
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S) as c:
        yield c


def decode_av(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)]), stream.rate


def test_create_returns_a_wav_of_the_expected_length(client: openai.OpenAI, engine) -> None:
    response = client.audio.speech.create(model="fake", voice="alice", input="hello", response_format="wav")
    x, sr = sf.read(io.BytesIO(response.content))
    assert sr == 24000 and len(x) == expected_samples(engine)
    assert "x-ttfa-ms" in response.response.headers


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm", "mp3", "opus", "aac"])
def test_every_format_decodes(client: openai.OpenAI, engine, fmt: str) -> None:
    data = client.audio.speech.create(
        model="tts-1", voice="alice", input="hello", response_format=fmt
    ).content
    seconds = engine.n_chunks * engine.chunk_s
    if fmt in ("wav", "flac"):  # soundfile
        x, sr = sf.read(io.BytesIO(data))
        assert len(x) == expected_samples(engine) and sr == 24000
    elif fmt == "pcm":  # numpy: raw s16le at the model rate
        assert len(np.frombuffer(data, "<i2")) == expected_samples(engine)
    else:  # PyAV
        x, sr = decode_av(data)
        assert seconds <= len(x) / sr <= seconds + 0.12


def test_streaming_response_yields_bytes_before_synthesis_ends(client: openai.OpenAI, engine) -> None:
    engine.delay_s = 0.25  # 4 chunks, 1 s of synthesis
    completed = engine.completed
    with client.audio.speech.with_streaming_response.create(
        model="fake", voice="alice", input="hello", response_format="pcm"
    ) as response:
        pieces: list[bytes] = []
        active_at_first, completed_at_first = None, None
        for piece in response.iter_bytes():
            if active_at_first is None:  # the engine's state when the first bytes came, not the clock's
                active_at_first, completed_at_first = len(engine.active), engine.completed
            pieces.append(piece)
    assert active_at_first == 1, "the first bytes came only after the engine stream ended"
    assert completed_at_first == completed and engine.completed == completed + 1
    assert len(b"".join(pieces)) == 2 * expected_samples(engine)


def test_sse_events_parse(client: openai.OpenAI, engine) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="fake", voice="alice", input="hello", response_format="wav", stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [
            json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= engine.n_chunks and events[-1]["type"] == "speech.audio.done"
    x, _ = sf.read(io.BytesIO(b"".join(base64.b64decode(e["audio"]) for e in deltas)))
    assert len(x) == expected_samples(engine)
    assert events[-1]["metrics"]["rtf"] > 0 and events[-1]["usage"]["output_tokens"] > 0


def test_errors_surface_as_openai_exceptions(client: openai.OpenAI, server: str, engine) -> None:
    with pytest.raises(openai.NotFoundError, match="no saved voice 'nova'"):
        client.audio.speech.create(model="fake", voice="nova", input="hello")
    with pytest.raises(openai.UnprocessableEntityError):
        client.audio.speech.create(model="fake", voice="alice", input="hello", speed=4.5)
    with (
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0) as intruder,
        pytest.raises(openai.AuthenticationError),
    ):
        intruder.audio.speech.create(model="fake", voice="alice", input="hello")
    engine.fail_first = Busy("64 requests are waiting", retry_after_s=2.0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.audio.speech.create(model="fake", voice="alice", input="hello")
    assert caught.value.response.headers["retry-after"] == "2"


def test_models_list(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "fake" and {"tts-1", "whisper-1", "fake-whisper"} <= set(ids)


def test_client_disconnect_aborts_the_engine_request(server: str, engine) -> None:
    engine.delay_s, engine.n_chunks = 0.05, 100  # 5 s of synthesis unless aborted
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(base_url=server, headers=headers, timeout=WAIT_S) as http,
        http.stream("POST", "/v1/audio/speech", json={"input": "hi", "voice": "alice"}) as response,
    ):
        request_id = response.headers["x-request-id"]
        next(response.iter_raw())
    # the connection is closed here, long before the 100th chunk
    assert wait_until(lambda: request_id in engine.aborted and not engine.active)
    assert engine.requests[-1].request_id == request_id


def test_metrics_parse_on_the_live_server(server: str, client: openai.OpenAI) -> None:
    client.audio.speech.create(model="fake", voice="alice", input="hello")
    text = httpx.get(f"{server}/metrics").text
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {
        "cosystream_http_requests_total",
        "cosystream_ttfa_seconds_count",
        "cosystream_queue_depth",
    } <= names


def test_streams_read_to_their_end_are_not_counted_as_disconnects(caplog) -> None:
    """uvicorn reports ``http.disconnect`` to the listener as soon as the last body message is sent: a
    complete stream must still count as complete, not as a client that left (nor be aborted)."""
    engine = RecordingEngine(n_chunks=3, chunk_s=0.1, delay_s=0.0)
    engine.add_voice("alice", "unused.wav", "the prompt transcript")
    payload = {"input": "hi", "voice": "alice", "response_format": "pcm"}
    with (
        live_server(build_api(engine, api_key="")) as url,
        httpx.Client(base_url=url, timeout=WAIT_S) as http,
    ):
        for i in range(20):
            sse = {"stream_format": "sse"} if i % 2 else {}
            with http.stream("POST", "/v1/audio/speech", json=payload | sse) as response:
                assert response.status_code == 200 and response.read()
        assert wait_until(lambda: engine.completed == 20 and not engine.active)
        families = text_string_to_metric_families(http.get("/metrics").text)
    values = {s.name: s.value for f in families for s in f.samples}
    assert values["cosystream_client_disconnects_total"] == 0
    assert engine.aborted == []
    assert "client left" not in caplog.text
