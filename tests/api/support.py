"""Helpers of the API tests: a FakeEngine that records requests, audio payloads, OpenAI error checks, and a
live uvicorn server on 127.0.0.1 (a thread; stopped at the end)."""

from __future__ import annotations

import base64
import io
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import soundfile as sf
import uvicorn
from fastapi import FastAPI

from engine.request import AudioChunk, SynthesisRequest
from tests.conftest import WAIT_S
from tests.fakes import FakeEngine


class RecordingEngine(FakeEngine):
    """FakeEngine that keeps every request and every add_voice call (and can fail on demand)."""

    def __init__(
        self, *args: Any, fail_first: Exception | None = None, fail_after: Exception | None = None, **kw
    ):
        super().__init__(*args, **kw)
        self.requests: list[SynthesisRequest] = []
        self.voice_calls: list[dict[str, Any]] = []
        self.fail_first, self.fail_after = fail_first, fail_after

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.requests.append(req)
        if self.fail_first is not None:
            raise self.fail_first
        async for chunk in super().stream(req):
            yield chunk
            if self.fail_after is not None:
                raise self.fail_after

    def add_voice(
        self, name: str, prompt_wav: str, prompt_text: str, owner: str | None = None, consent: str = ""
    ) -> Any:
        data = None
        if os.path.exists(prompt_wav):  # an upload's file must exist while the engine reads it
            with open(prompt_wav, "rb") as f:
                data = f.read()
        call = {"name": name, "path": prompt_wav, "text": prompt_text, "data": data, "consent": consent}
        self.voice_calls.append(call)
        return super().add_voice(name, prompt_wav, prompt_text, owner, consent)


def expected_samples(engine: FakeEngine) -> int:
    return engine.n_chunks * int(engine.chunk_s * engine.sample_rate)


def speech_like(seconds: float = 2.0, sr: int = 16000) -> np.ndarray:
    """An audible, non-silent test signal (two tones), float32 mono."""
    t = np.arange(int(seconds * sr)) / sr
    return (0.2 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 530 * t)).astype(np.float32)


def wav_bytes(seconds: float = 2.0, sr: int = 16000, silent: bool = False) -> bytes:
    x = speech_like(seconds, sr) * (0.0 if silent else 1.0)
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.test")


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The body is exactly OpenAI's error shape, with no stack trace."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in response.text
    assert isinstance(error["code"], str) and error["code"], "every error names its code"
    if param is not None:
        assert error["param"] == param
    return error


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """uvicorn on a free port of 127.0.0.1 in a daemon thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_until(predicate: Any, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())
