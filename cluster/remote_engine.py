"""The engine-shaped object the ingress hands to ``api/`` and ``webui/``: calls go to the engine replicas
through a Serve ``DeploymentHandle`` (least-loaded routing), gauges come from the replicas' reports.

Errors come back as the engine's own classes, so the API and the UI answer as in one process: a replica's
``EngineError`` is re-raised as is; Serve's full queue is ``Busy`` (429 + Retry-After); a replica that
died under a request is ``NotReady`` for that request (503), while new requests go to the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from cluster.board import ReplicaReport
from cluster.engine_replica import EngineInfo
from cluster.parcel import pack, ship_audio
from engine.errors import Busy, EngineError, NotReady
from engine.request import AudioChunk, SynthesisRequest
from engine.serving.metrics import ServerStats

log = logging.getLogger(__name__)

T = TypeVar("T")
BUSY_RETRY_S = 1.0
REPLICA_LOST_RETRY_S = 1.0


@dataclass(eq=False)
class _Call:
    """A stream in flight on some replica; ``abort`` finds it by request id and cancels it there."""

    request_id: str
    response: Any = field(repr=False)  # DeploymentResponseGenerator


class RemoteEngine:
    def __init__(self, handle: Any, board: Any, info: EngineInfo, refresh_s: float):
        self.handle, self.board, self.refresh_s = handle, board, refresh_s
        self.streams = handle.options(stream=True)  # shares the handle's router: one queue, one view of load
        self.model_name, self.family, self.sample_rate = info.model_name, info.family, info.sample_rate
        self.presets = list(info.instruct_presets)
        self.asr_model, self.examples = info.asr_model, list(info.examples)
        self._reports: list[ReplicaReport] = []
        self._calls: set[_Call] = set()
        self._watcher: asyncio.Task[None] | None = None

    # ---- state, from the replicas' latest reports --------------------------------------------------
    @property
    def ready(self) -> bool:
        return any(r.ready for r in self._reports)

    @property
    def healthy(self) -> bool:
        """True while one replica can compute: the ingress serves; Serve replaces the dead ones."""
        return any(r.healthy for r in self._reports)

    def replicas(self) -> list[ReplicaReport]:
        return list(self._reports)

    def stats(self) -> ServerStats:
        """The sum over live replicas; the device names each replica's device once."""
        parts = [r.stats for r in self._reports]
        devices = ",".join(sorted({s.device for s in parts})) or "none"
        return ServerStats(
            active_streams=sum(s.active_streams for s in parts),
            queued=sum(s.queued for s in parts),
            completed=sum(s.completed for s in parts),
            failed=sum(s.failed for s in parts),
            cancelled=sum(s.cancelled for s in parts),
            audio_s_total=sum(s.audio_s_total for s in parts),
            lm_tokens_total=sum(s.lm_tokens_total for s in parts),
            device_memory_mb=sum(s.device_memory_mb for s in parts),
            device=f"{len(parts)} replicas: {devices}",
        )

    async def refresh(self) -> None:
        self._reports = await self.board.reports.remote()

    async def warmup(self) -> None:
        """Start following the board (the app's lifespan calls this while ``ready`` is False)."""
        await self.refresh()
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch())

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch(self) -> None:
        while True:  # the board is pushed to every report interval; read it as often
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except ray.exceptions.RayError as err:
                log.warning("could not read the replica board: %s", err)

    # ---- requests ----------------------------------------------------------------------------------
    async def stream(self, req: SynthesisRequest) -> AsyncGenerator[AudioChunk, None]:
        parcel = await asyncio.to_thread(pack, req)  # reads uploads named by path on this host
        call = _Call(req.request_id, self.streams.stream.remote(parcel))
        self._calls.add(call)
        try:
            async for chunk in _engine_errors(call.response):
                yield chunk
        finally:
            self._calls.discard(call)
            call.response.cancel()  # a no-op once finished; otherwise the replica's stream is cancelled

    def abort(self, request_id: str) -> bool:
        for call in list(self._calls):
            if call.request_id == request_id:
                call.response.cancel()
                return True
        return False

    def instruct_presets(self) -> list[str]:
        return list(self.presets)

    async def add_voice(self, name: str, prompt_wav: Any, prompt_text: str, *args: Any) -> Any:
        audio = await asyncio.to_thread(ship_audio, prompt_wav)
        return await _call(lambda: self.handle.add_voice.remote(name, audio, prompt_text, *args))

    async def list_voices(self, *args: Any) -> Any:
        return await _call(lambda: self.handle.list_voices.remote(*args))

    def example_voices(self) -> list[Any]:
        return list(self.examples)

    async def transcribe(self, audio: Any, language: str | None = None) -> Any:
        shipped = await asyncio.to_thread(ship_audio, audio)
        return await _call(lambda: self.handle.transcribe.remote(shipped, language))

    async def delete_voice(self, voice_id: str, *args: Any) -> Any:
        return await _call(lambda: self.handle.delete_voice.remote(voice_id, *args))


async def _call(send: Callable[[], Awaitable[T]]) -> T:
    try:
        return await send()
    except Exception as err:
        raise _engine_error(err) from err


async def _engine_errors(chunks: Any) -> AsyncIterator[AudioChunk]:
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as err:
        raise _engine_error(err) from err


def _engine_error(err: Exception) -> Exception:
    """Serve's and Ray's errors as the engine's: the replica's own ``EngineError``, ``Busy`` for a full
    queue, ``NotReady`` for a lost replica; anything else unchanged."""
    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
    if isinstance(cause, EngineError):
        return cause
    if isinstance(cause, BackPressureError):
        retry_s = cause.retry_after_s or BUSY_RETRY_S
        return Busy("every engine replica is busy and the queue is full", retry_after_s=retry_s)
    if isinstance(cause, ray.exceptions.RayActorError | DeploymentUnavailableError):
        log.error("an engine replica was lost under a request: %s", cause)
        message = "the engine replica serving this request stopped; retry"
        return NotReady(message, retry_after_s=REPLICA_LOST_RETRY_S)
    return err
