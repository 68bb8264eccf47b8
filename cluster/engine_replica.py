"""The engine deployment: each replica is one whole ``TTSEngine`` (speech LM + token2wav) on its own device.

Serve routes every call to the least-loaded replica; ``stream`` yields the engine's ``AudioChunk``s back to
the caller's handle. A cancelled call (the client left) raises ``CancelledError`` inside the engine's
stream, whose ``finally`` frees the request exactly as in one process. ``check_health`` fails once the
engine's workers stopped, so Serve replaces the replica while the others keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve

from cluster.board import ReplicaBoard, ReplicaReport
from cluster.parcel import Parcel, local_audio, unpacked
from engine.cache_root import cache_root
from engine.config import DEMO_TINY, EngineConfig
from engine.request import AudioChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs once, before it builds the UI: the same on every replica."""

    model_name: str
    family: str
    sample_rate: int
    instruct_presets: tuple[str, ...]
    asr_model: str | None = None  # the replicas' Whisper, None when transcription is off
    examples: tuple[Any, ...] = ()  # the example voices (``ExampleVoice``), the same files on every host


def board_actor(name: str, stale_s: float) -> Any:
    """The application's board, created by whichever replica or ingress asks first. Detached: it must
    outlive the replica that happened to create it."""
    actor = ray.remote(ReplicaBoard).options(
        name=name,
        namespace="cosystream",
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
    )
    return actor.remote(stale_s)


def own_cache(cfg: EngineConfig) -> EngineConfig:
    """demo-tiny writes its model into the cache dir: give each replica its own (replicas on one host
    would overwrite each other's files while loading them), and keep the voices in the shared dir."""
    if cfg.model != DEMO_TINY:
        return cfg
    shared = cache_root(cfg.cache_dir)
    voices = cfg.voices_dir or str(shared / "voices")
    return replace(cfg, cache_dir=tempfile.mkdtemp(prefix="cosystream-replica-"), voices_dir=voices)


class EngineReplica:
    async def __init__(self, cfg: EngineConfig, board: str, interval_s: float, stale_s: float):  # type: ignore[misc]  # Serve awaits it
        from server.cli import build_engine  # the single-process server's loader (demo-tiny included)

        self.cfg = own_cache(cfg)
        self.engine = await asyncio.to_thread(build_engine, self.cfg)
        await self.engine.warmup()  # before Serve marks the replica running and routes to it
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.actor = ray.get_runtime_context().get_actor_name() or self.replica
        self.board = board_actor(board, stale_s)
        self._reporter = asyncio.create_task(self._report_every(interval_s))
        log.info("engine replica %s ready (%s)", self.replica, self.engine.model_name)

    async def stream(self, parcel: Parcel) -> AsyncIterator[AudioChunk]:
        with unpacked(parcel) as req:
            async for chunk in self.engine.stream(req):
                yield chunk

    def info(self) -> EngineInfo:
        eng = self.engine
        presets, examples = tuple(eng.instruct_presets()), tuple(eng.example_voices())
        return EngineInfo(eng.model_name, eng.family, eng.sample_rate, presets, eng.asr_model, examples)

    async def transcribe(self, audio: Any, language: str | None = None) -> Any:
        """``audio`` as for ``add_voice``; the engine's Whisper runs in its worker thread."""
        with local_audio(audio) as local:
            return await self.engine.transcribe(local, language)

    async def add_voice(self, name: str, audio: Any, prompt_text: str, *args: Any) -> Any:
        """``audio`` is a ``ShippedFile`` from the ingress's host or decoded audio; ``args`` pass through
        (e.g. an owner) to the engine unchanged."""
        with local_audio(audio) as local:
            return await asyncio.to_thread(self.engine.add_voice, name, local, prompt_text, *args)

    async def list_voices(self, *args: Any) -> Any:
        return await asyncio.to_thread(self.engine.list_voices, *args)

    async def delete_voice(self, voice_id: str, *args: Any) -> Any:
        return await asyncio.to_thread(self.engine.delete_voice, voice_id, *args)

    def check_health(self) -> None:
        """Serve's periodic probe: raising makes Serve replace this replica."""
        if not self.engine.healthy:
            raise RuntimeError(f"engine replica {self.replica}: the LM backend or token2wav worker stopped")

    def report(self) -> ReplicaReport:
        eng = self.engine
        node = socket.gethostname()
        return ReplicaReport(self.replica, self.actor, node, eng.ready, eng.healthy, eng.stats(), time.time())

    async def _report_every(self, interval_s: float) -> None:
        # a heartbeat, not a request path: the board's only way to know this replica's gauges and liveness
        while True:
            try:
                await self.board.report.remote(self.report())
            except ray.exceptions.RayError as err:  # the board restarts with the app; keep serving
                log.warning("replica %s could not report: %s", self.replica, err)
            await asyncio.sleep(interval_s)

    def __del__(self) -> None:
        """Serve's clean shutdown of this replica (a crash skips it; the board then ages it out)."""
        self._reporter.cancel()
        with contextlib.suppress(ray.exceptions.RayError):
            self.board.forget.remote(self.replica)
        self.engine.close()
        if self.cfg.model == DEMO_TINY and self.cfg.cache_dir:  # the replica's own scratch model
            shutil.rmtree(self.cfg.cache_dir, ignore_errors=True)
