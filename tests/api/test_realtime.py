"""``WS /v1/audio/speech/realtime`` with a real WebSocket client (``websockets``) against a live uvicorn on
127.0.0.1 serving the API over the real engine on the tiny cosyvoice3 model (demo-tiny's model)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
        limits=Limits(max_concurrency=2, max_queue=4, max_text_chars=300),
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


@pytest.mark.parametrize(
    ("first", "code", "param"),
    [
        ({"type": "input_text_buffer.append", "text": "hi"}, "invalid_event", "type"),
        ({"type": "session.update", "session": {"response_format": "mp3"}}, "invalid_value", None),
        ({"type": "session.update", "session": {"voice": "nobody"}}, "voice_not_found", "voice"),
    ],
    ids=["append-before-session", "bad-format", "unknown-voice"],
)
def test_bad_sessions_get_openai_style_error_events(url: str, first: dict[str, Any], code: str, param):
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps(first))
        if first["type"] == "session.update" and code == "voice_not_found":
            send(ws, "input_text_buffer.append", text="Hello there.")
            send(ws, "input_text_buffer.commit")
        got = [e for e in events(ws) if e["type"] == "error"]
    assert len(got) == 1 and got[0]["error"]["code"] == code
    assert param is None or got[0]["error"]["param"] == param


def test_too_much_text_is_an_error_event_and_the_server_keeps_serving(url: str) -> None:
    with open_session(url) as ws:
        send(ws, "input_text_buffer.append", text="word " * 80)
        errors = [e["error"] for e in events(ws) if e["type"] == "error"]
    assert errors and errors[0]["code"] == "too_large" and "300 characters" in errors[0]["message"]
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
