"""The server listens while the engine loads: /health answers, /ready and requests get 503 + Retry-After
until the engine is built and warm, then every call is the engine's; a failed load makes it unhealthy
(the server then exits for its supervisor). The engine is the API tests' fake, built on a held thread."""

from __future__ import annotations

import asyncio
import threading

from api.app import build_api
from engine.config import Limits
from engine.serving.startup import Timeline
from server.pending_engine import PendingEngine
from tests.api.support import RecordingEngine, client_for

WAIT_S = 120.0  # generous: the machine is slow and shared
SPEECH = "/v1/audio/speech"
BODY = {"model": "cosyvoice", "input": "hello there", "voice": "alice", "stream": False}


class Warming(RecordingEngine):
    """A fake engine that is warmed and closed like TTSEngine."""

    def __init__(self) -> None:
        super().__init__(n_chunks=2, chunk_s=0.2, delay_s=0.0)
        self.ready, self.warmed, self.closed = False, False, False
        self.add_voice("alice", "unused.wav", "the prompt transcript")

    async def warmup(self) -> None:
        self.warmed = self.ready = True

    def close(self) -> None:
        self.closed = True


async def test_health_answers_while_the_engine_loads_and_requests_are_served_once_it_is_warm() -> None:
    built, loading, go = Warming(), threading.Event(), threading.Event()

    def load() -> Warming:
        loading.set()
        assert go.wait(WAIT_S)
        return built

    pending = PendingEngine("demo-tiny", load, Timeline())
    async with client_for(build_api(pending, Limits(), api_key="")) as client:
        start = asyncio.create_task(pending.start())
        assert await asyncio.to_thread(loading.wait, WAIT_S)
        assert (await client.get("/health")).status_code == 200
        ready = await client.get("/ready")
        assert ready.status_code == 503 and "Retry-After" in ready.headers
        early = await client.post(SPEECH, json=BODY)
        assert early.status_code == 503 and "Retry-After" in early.headers, early.text
        assert "still loading" in early.json()["error"]["message"] and built.requests == []
        models = (await client.get("/v1/models")).json()["data"]
        assert models and not any(m["ready"] for m in models)
        go.set()
        await asyncio.wait_for(start, WAIT_S)
        assert built.warmed and pending.ready
        body = (await client.get("/ready")).json()
        assert body["model"] == built.model_name and body["family"] == built.family
        served = await client.post(SPEECH, json=BODY)
        assert served.status_code == 200 and len(served.content) > 44 and len(built.requests) == 1
        assert [v.name for v in pending.list_voices(None)] == ["alice"]  # the rest is the engine's
    pending.close()
    assert built.closed


async def test_a_failed_load_leaves_the_server_alive_but_unhealthy(caplog) -> None:
    def load() -> Warming:
        raise RuntimeError("no such model")

    pending = PendingEngine("missing", load, Timeline())
    with caplog.at_level("ERROR", "cosystream"):
        await asyncio.wait_for(pending.start(), WAIT_S)
    assert not pending.healthy and not pending.ready and "could not be loaded" in caplog.text
    async with client_for(build_api(pending, Limits(), api_key="")) as client:
        assert (await client.get("/health")).status_code == 503
    pending.close()  # nothing was built: nothing to close


async def test_the_model_facts_are_known_once_built_before_the_warm_up_ends() -> None:
    """The studio is built during the warm-up: the name, family, presets and example voices are the built
    engine's from then on, while requests still wait for it to be warm."""
    from engine.errors import NotReady

    built, go = Warming(), asyncio.Event()

    async def held_warmup() -> None:
        await go.wait()
        built.ready = True

    built.warmup = held_warmup  # type: ignore[method-assign]
    pending = PendingEngine("asked-for-name", lambda: built, Timeline())
    assert pending.model_name == "asked-for-name" and pending.family == ""
    try:
        pending.instruct_presets()
    except NotReady as err:
        assert "still loading" in str(err)
    else:
        raise AssertionError("the presets of a model not built yet cannot be known")
    start = asyncio.create_task(pending.start())
    assert await asyncio.wait_for(pending.built(), WAIT_S) and not pending.ready
    assert (pending.model_name, pending.family) == (built.model_name, built.family)
    assert pending.instruct_presets() == built.instruct_presets()
    assert pending.example_voices() == built.example_voices()
    go.set()
    await asyncio.wait_for(start, WAIT_S)
    assert pending.ready


async def test_waiting_for_the_build_ends_when_the_load_fails() -> None:
    def load() -> Warming:
        raise RuntimeError("no such model")

    pending = PendingEngine("missing", load, Timeline())
    start = asyncio.create_task(pending.start())
    assert await asyncio.wait_for(pending.built(), WAIT_S) is False
    await start
