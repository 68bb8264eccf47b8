"""RemoteEngine over a fake Serve handle: chunks pass through, Serve's and Ray's errors become the engine's
(so the API answers as in one process), cancellation reaches the replica's call, gauges add up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.serve.exceptions import BackPressureError  # noqa: E402

from api.app import build_api  # noqa: E402
from cluster.board import ReplicaReport  # noqa: E402
from cluster.engine_replica import EngineInfo  # noqa: E402
from cluster.parcel import Parcel, ShippedFile  # noqa: E402
from cluster.remote_engine import RemoteEngine  # noqa: E402
from engine.errors import Busy, NotFound, NotReady  # noqa: E402
from engine.request import AudioChunk, SynthesisRequest  # noqa: E402
from engine.serving.metrics import RequestMetrics, ServerStats  # noqa: E402

INFO = EngineInfo("tiny", "cosyvoice3", 24000, ("calm",))


def chunk(i: int, last: bool = False) -> AudioChunk:
    pcm = np.zeros(0 if last else 240, np.float32)
    return AudioChunk(pcm, 24000, i, last, RequestMetrics(request_id="r", seed=0))


class Response:
    """A DeploymentResponseGenerator stand-in: yields ``chunks`` then raises ``fail`` (if any)."""

    def __init__(self, chunks: list[AudioChunk], fail: BaseException | None = None, hold: bool = False):
        self.chunks, self.fail, self.hold = chunks, fail, hold
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def _gen(self) -> AsyncIterator[AudioChunk]:
        for c in self.chunks:
            yield c
        if self.hold:  # a long stream: runs until cancelled
            await self.cancelled.wait()
        if self.fail is not None:
            raise self.fail

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._gen()


class Method:
    def __init__(self, handle: Handle, name: str):
        self.handle, self.name = handle, name

    def remote(self, *args: Any) -> Any:
        self.handle.calls.append((self.name, args))
        if self.name == "stream":
            return self.handle.responses.pop(0)
        return self._answer(args)

    async def _answer(self, args: tuple[Any, ...]) -> Any:
        if self.handle.raises is not None:
            raise self.handle.raises
        return {"method": self.name, "args": args}


class Handle:
    def __init__(self, responses: list[Response] | None = None, raises: Exception | None = None):
        self.responses, self.raises = list(responses or []), raises
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def options(self, **_: Any) -> Handle:
        return self

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)


class Board:
    def __init__(self, reports: list[ReplicaReport]):
        self.reports_list = reports

    @property
    def reports(self) -> Any:
        board = self

        class _Remote:
            async def remote(self) -> list[ReplicaReport]:
                return board.reports_list

        return _Remote()


def report(replica: str, stats: ServerStats, ready: bool = True) -> ReplicaReport:
    return ReplicaReport(replica, "a-" + replica, "node", ready, True, stats, time.time())


def remote(handle: Handle, reports: list[ReplicaReport] | None = None) -> RemoteEngine:
    return RemoteEngine(
        handle, Board(reports if reports is not None else [report("r1", ServerStats())]), INFO, 60
    )


async def collect(engine: RemoteEngine, req: SynthesisRequest) -> list[AudioChunk]:
    return [c async for c in engine.stream(req)]


async def test_chunks_pass_through_and_uploads_travel_as_bytes(tmp_path: Path) -> None:
    prompt = tmp_path / "p.wav"
    prompt.write_bytes(b"RIFF....")
    handle = Handle([Response([chunk(0), chunk(1, last=True)])])
    got = await collect(remote(handle), SynthesisRequest(text="hi", prompt_wav=str(prompt)))
    assert [c.index for c in got] == [0, 1] and got[-1].is_last
    ((name, (parcel,)),) = handle.calls
    assert name == "stream" and isinstance(parcel, Parcel) and parcel.request.prompt_wav is None
    assert parcel.files == (("prompt_wav", ShippedFile("p.wav", b"RIFF....")),)


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (BackPressureError(num_queued_requests=2, max_queued_requests=2), Busy),
        (ray.exceptions.RayTaskError("stream", "tb", NotFound("no saved voice 'x'")), NotFound),
        (ray.exceptions.ActorDiedError(), NotReady),
    ],
)
async def test_serve_errors_become_engine_errors(raised: Exception, expected: type) -> None:
    handle = Handle([Response([chunk(0)], fail=raised)])
    with pytest.raises(expected):
        await collect(remote(handle), SynthesisRequest(text="hi"))


async def test_a_full_queue_is_the_same_429_with_retry_after() -> None:
    full = BackPressureError(num_queued_requests=4, max_queued_requests=4)
    engine = remote(Handle([Response([], fail=full)]))
    await engine.refresh()  # a replica reports ready: the API does not answer "still loading"
    transport = httpx.ASGITransport(app=build_api(engine, api_key=""))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "x"})
    assert r.status_code == 429 and float(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"


async def test_abort_and_early_close_cancel_the_replica_call() -> None:
    held, left = Response([chunk(0)], hold=True), Response([chunk(0)], hold=True)
    engine = remote(Handle([held, left]))
    req = SynthesisRequest(text="hi")
    stream = engine.stream(req)
    assert (await anext(stream)).index == 0
    assert engine.abort(req.request_id) and held.cancelled.is_set()
    assert not engine.abort("someone-else")
    early = engine.stream(SynthesisRequest(text="hi"))
    await anext(early)
    await early.aclose()  # type: ignore[attr-defined]  # the client left
    assert left.cancelled.is_set()


async def test_voice_calls_ship_the_upload_and_map_errors(tmp_path: Path) -> None:
    wav = tmp_path / "v.wav"
    wav.write_bytes(b"voice")
    handle = Handle()
    answer = await remote(handle).add_voice("alice", str(wav), "hello", "owner-1")
    assert answer["args"] == ("alice", ShippedFile("v.wav", b"voice"), "hello", "owner-1")
    failing = Handle(raises=ray.exceptions.RayTaskError("delete_voice", "tb", NotFound("no voice")))
    with pytest.raises(NotFound):
        await remote(failing).delete_voice("nobody")


async def test_gauges_add_up_over_the_reporting_replicas() -> None:
    reports = [report("r1", ServerStats(2, 1, 5, audio_s_total=1.5)), report("r2", ServerStats(1, 0, 2))]
    engine = remote(Handle(), reports)
    assert not engine.ready and not engine.healthy  # nothing read yet
    await engine.warmup()
    try:
        stats = engine.stats()
        assert (stats.active_streams, stats.queued, stats.completed) == (3, 1, 7)
        assert stats.audio_s_total == 1.5 and stats.device.startswith("2 replicas")
        assert engine.ready and engine.healthy and len(engine.replicas()) == 2
    finally:
        engine.close()


async def test_the_api_lists_voices_through_the_remote_engine() -> None:
    class Voices(Handle):
        def __getattr__(self, name: str) -> Method:
            method = Method(self, name)

            async def answer(args: tuple[Any, ...]) -> Any:
                return [{"id": "alice", "name": "alice", "prompt_text": "hi"}]

            method._answer = answer  # type: ignore[method-assign]
            return method

    transport = httpx.ASGITransport(app=build_api(remote(Voices()), api_key=""))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        listing = await client.get("/v1/audio/voices")
        one = await client.get("/v1/audio/voices/alice")
    assert listing.status_code == 200 and listing.json()["voices"] == ["alice"]
    assert one.status_code == 200 and one.json()["id"] == "alice"
