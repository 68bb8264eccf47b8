"""Device faults on a real tiny engine: a non-finite output (vocoder or flow returning NaN) or an
out-of-memory error in one request fails that request cleanly, at every entry point (engine API
``SynthesisFailed``, HTTP 500 JSON or an SSE error event, UI: a "failed" status),
and the engine stays usable."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from api.app import build_api
from engine.errors import NotReady, SynthesisFailed
from engine.serving.engine import TTSEngine
from tests.api.support import assert_openai_error
from tests.reliability.support import (
    LIMITS,
    TEXT,
    Bounded,
    assert_serves,
    check_pcm,
    collect,
    good_request,
    idle_state,
    load_engine,
    wait_idle,
)
from tests.sounds import write_wav
from webui.handlers import Form, Studio
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts

NON_FINITE = "the vocoder produced non-finite audio; this request was stopped"
OOM = "ran out of memory"


@pytest.fixture(scope="module")
def odd_prompt(tmp_path_factory) -> Path:
    """2 s: its speech-token count marks the faulty request (the others use the 1.5 s prompt)."""
    return write_wav(tmp_path_factory.mktemp("odd") / "odd.wav", 2.0, seed=5)


@pytest.fixture(scope="module")
def odd_tokens(engine, odd_prompt) -> int:
    return int(engine.frontend.extract(str(odd_prompt)).speech_tokens.size)


def is_marked(utt: Any, tokens: int) -> bool:
    return bool(utt.prompt_tokens.shape[1] == tokens)


def nan_vocoder(engine: TTSEngine, monkeypatch, tokens: int, from_chunk: int = 0) -> None:
    """HiFT returns NaN for the marked request, from its ``from_chunk``-th chunk on."""
    real, calls = engine.token2wav._vocode, {"n": 0}

    def vocode(utt, mel, finalize):
        out = real(utt, mel, finalize)
        if is_marked(utt, tokens):
            calls["n"] += 1
            if calls["n"] > from_chunk:
                return torch.full_like(out, float("nan"))
        return out

    real_batch = engine.token2wav._vocode_batch

    def vocode_batch(utts, mel):  # v3 rows vocoded together: the marked row turns NaN
        out = real_batch(utts, mel)
        for row, utt in enumerate(utts):
            if is_marked(utt, tokens):
                calls["n"] += 1
                if calls["n"] > from_chunk:
                    out[row] = float("nan")
        return out

    monkeypatch.setattr(engine.token2wav, "_vocode", vocode)
    monkeypatch.setattr(engine.token2wav, "_vocode_batch", vocode_batch)


def nan_flow(engine: TTSEngine, monkeypatch, tokens: int) -> None:
    """The flow's mel for the marked request is NaN (its batch-mates' rows are untouched)."""
    real = engine.token2wav._flow

    def flow(utts, chunks):
        mels = real(utts, chunks)
        return [torch.full_like(m, float("nan")) if is_marked(u, tokens) else m for u, m in zip(utts, mels)]

    monkeypatch.setattr(engine.token2wav, "_flow", flow)


def oom_flow_once(engine: TTSEngine, monkeypatch, tokens: int) -> None:
    """The flow raises CUDA's out-of-memory error once, for the marked request."""
    real, raised = engine.token2wav._flow, []

    def flow(utts, chunks):
        if not raised and any(is_marked(u, tokens) for u in utts):
            raised.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(utts, chunks)

    monkeypatch.setattr(engine.token2wav, "_flow", flow)


FAULTS: dict[str, Callable[..., None]] = {"nan_vocoder": nan_vocoder, "nan_flow": nan_flow}


# ================================================================================================ engine


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_non_finite_output_fails_only_that_request(
    engine, prompt, odd_prompt, odd_tokens, monkeypatch, fault, stream
):
    FAULTS[fault](engine, monkeypatch, odd_tokens)
    failed = engine.stats().failed
    with pytest.raises(SynthesisFailed, match=NON_FINITE):
        await collect(engine, good_request(odd_prompt, forced_tokens=60, stream=stream))
    assert engine.stats().failed == failed + 1
    assert await wait_idle(engine), idle_state(engine)
    await assert_serves(engine, prompt)  # other requests are untouched even with the fault still armed


async def test_non_finite_mid_stream_keeps_the_chunks_already_sent(
    engine, odd_prompt, odd_tokens, monkeypatch
):
    nan_vocoder(engine, monkeypatch, odd_tokens, from_chunk=1)
    got = []
    with pytest.raises(SynthesisFailed, match=NON_FINITE):
        async for chunk in engine.stream(good_request(odd_prompt, forced_tokens=120, stream=True)):
            got.append(chunk)
    assert len(got) == 1 and np.isfinite(got[0].pcm).all()  # the NaN chunk itself is never handed out
    assert await wait_idle(engine), idle_state(engine)


async def test_out_of_memory_fails_only_that_request(engine, prompt, odd_prompt, odd_tokens, monkeypatch):
    """A clear SynthesisFailed, and the engine stays usable: the next request, even the same one, succeeds."""
    oom_flow_once(engine, monkeypatch, odd_tokens)
    with pytest.raises(SynthesisFailed, match=OOM):
        await collect(engine, good_request(odd_prompt))
    assert await wait_idle(engine), idle_state(engine)
    check_pcm(np.concatenate([c.pcm for c in await collect(engine, good_request(odd_prompt))]))
    await assert_serves(engine, prompt)


# ================================================================================================== HTTP


@pytest.fixture
async def http(engine):
    transport = httpx.ASGITransport(app=build_api(Bounded(engine, 60), LIMITS, api_key=""))
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test", timeout=30) as client:
        yield client


def body(prompt: Path, **kw: Any) -> dict[str, Any]:
    ref = base64.b64encode(prompt.read_bytes()).decode("ascii")
    return {"input": TEXT, "mode": "cross_lingual", "ref_audio": ref, "seed": 1} | kw


async def http_serves(client: httpx.AsyncClient, prompt: Path) -> None:
    r = await client.post("/v1/audio/speech", json=body(prompt, stream=False))
    assert r.status_code == 200, r.text
    check_pcm(sf.read(io.BytesIO(r.content), dtype="float32")[0])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_http_non_finite_is_a_500_json_error(
    engine, http, prompt, odd_prompt, odd_tokens, monkeypatch, stream
):
    nan_vocoder(engine, monkeypatch, odd_tokens)
    r = await http.post("/v1/audio/speech", json=body(odd_prompt, stream=stream))
    error = assert_openai_error(r, 500)
    assert error["message"] == NON_FINITE and error["code"] == "synthesisfailed"
    assert await wait_idle(engine), idle_state(engine)
    await http_serves(http, prompt)


async def test_http_sse_non_finite_mid_stream_is_an_error_event(
    engine, http, prompt, odd_prompt, odd_tokens, monkeypatch
):
    nan_vocoder(engine, monkeypatch, odd_tokens, from_chunk=1)
    r = await http.post("/v1/audio/speech", json=body(odd_prompt, stream_format="sse", response_format="pcm"))
    assert r.status_code == 200  # the first chunk went out before the fault
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][:1] == ["speech.audio.delta"]
    assert events[-1]["type"] == "error" and events[-1]["error"]["message"] == NON_FINITE
    assert await wait_idle(engine), idle_state(engine)
    await http_serves(http, prompt)


async def test_http_out_of_memory_is_a_500_json_error(
    engine, http, prompt, odd_prompt, odd_tokens, monkeypatch
):
    oom_flow_once(engine, monkeypatch, odd_tokens)
    r = await http.post("/v1/audio/speech", json=body(odd_prompt, stream=False))
    error = assert_openai_error(r, 500)
    assert OOM in error["message"] and error["code"] == "synthesisfailed"
    assert await wait_idle(engine), idle_state(engine)
    await http_serves(http, prompt)


# ==================================================================================================== UI


async def test_ui_non_finite_is_a_clear_error(engine, monkeypatch, tmp_path, caplog):
    ui_prompt = str(write_wav(tmp_path / "p.wav", 3.0, seed=5))
    studio = Studio(Bounded(engine), LIMITS, Texts("en"), StreamHub(), AudioStore(tmp_path / "store"))
    values = {
        "mode": "cross_lingual", "prompt_wav": ui_prompt, "prompt_text": "", "instruct_text": "",
        "source_wav": None, "voice_id": None, "language": "auto", "text": TEXT, "stream": True,
        "speed": 1.0, "seed": 1, "rid": "cd" * 16, "history": [],
    }  # fmt: skip
    marked = int(engine.frontend.extract(ui_prompt).speech_tokens.size)
    nan_vocoder(engine, monkeypatch, marked)
    with caplog.at_level("WARNING"):
        failed = [out async for out in studio.generate(Form(**values))]
    # the page says the request failed, in its own words; the engine's text stays in the log
    assert 'data-state="failed"' in failed[-1][2] and NON_FINITE not in failed[-1][2]
    assert NON_FINITE in caplog.text
    assert await wait_idle(engine), idle_state(engine)
    monkeypatch.undo()
    outputs = [out async for out in studio.generate(Form(**(values | {"rid": "ef" * 16})))]
    check_pcm(sf.read(outputs[-1][0]["value"], dtype="float32")[0])


# ========================================================================================= LM backend death


class WorkerDied(BaseException):
    """What ends a thread outright (not an Exception the decode loop survives): a dead worker."""


@pytest.fixture
def doomed(model_dir, tmp_path) -> Iterator[TTSEngine]:
    """An engine of its own: its LM dies in the test."""
    eng = load_engine(model_dir, tmp_path / "voices")
    yield eng
    eng.close()


async def test_a_dead_lm_ends_streams_in_flight_with_an_error_and_ready_says_why(doomed, prompt, monkeypatch):
    real, steps = doomed.backend.lm.decode, []

    def decode(*args: Any, **kw: Any) -> Any:  # a few tokens out, then the decode thread dies
        steps.append(1)
        if len(steps) > 3:
            raise WorkerDied("the decode thread was killed")
        return real(*args, **kw)

    monkeypatch.setattr(doomed.backend.lm, "decode", decode)
    with pytest.raises(SynthesisFailed, match=r"speech LM stopped .*needs a restart"):
        async with asyncio.timeout(120):  # never a hang: a dead thread's requests are failed for it
            await collect(doomed, good_request(prompt, forced_tokens=None, stream=True))
    assert not doomed.healthy and doomed.stats().active_streams == 0
    with pytest.raises(NotReady, match="needs a restart"):
        await collect(doomed, good_request(prompt))
    transport = httpx.ASGITransport(app=build_api(doomed, LIMITS, api_key=""))
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test", timeout=30) as client:
        ready = await client.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "unhealthy"
    assert "stopped" in ready.json()["error"]["message"] and ready.headers["retry-after"]
