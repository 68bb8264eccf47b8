"""A small fake of ``engine.engine.TTSEngine`` for UI/API control-logic tests.

It has the same public surface as the real engine (see README "Engine API"): ``stream``, ``synthesize``,
``abort``, ``stats``, voices, ``info``. Audio is a 220 Hz sine, produced in ``chunk_s`` pieces with
``delay_s`` between them so cancellation and streaming can be observed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from engine.errors import InvalidInput, NotFound
from engine.metrics import ServerStats, Stopwatch
from engine.request import AudioChunk, Mode, SynthesisRequest


@dataclass(frozen=True)
class FakeVoice:
    id: str
    name: str
    prompt_text: str
    duration_s: float = 3.0
    created_at: float = field(default_factory=time.time)


class FakeEngine:
    sample_rate = 24000
    family = "cosyvoice3"
    model_name = "fake"

    def __init__(self, n_chunks: int = 4, chunk_s: float = 0.2, delay_s: float = 0.01):
        self.n_chunks, self.chunk_s, self.delay_s = n_chunks, chunk_s, delay_s
        self.active: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.completed = 0
        self.voices: dict[str, FakeVoice] = {}
        self.ready = True
        self.healthy = True

    def instruct_presets(self) -> list[str]:
        return ["用广东话表达。", "请用尽可能快地语速说一句话。"]

    def check(self, req: SynthesisRequest) -> None:
        if req.mode != Mode.VC and not req.text.strip():
            raise InvalidInput("text is empty", field="text")
        if req.voice_id is not None and req.voice_id not in self.voices:
            raise NotFound(f"no saved voice {req.voice_id!r}", field="voice_id")
        if (
            req.mode != Mode.VC
            and req.voice_id is None
            and req.prompt_wav is None
            and req.prompt_audio is None
        ):
            raise InvalidInput(
                "a prompt voice is needed: upload or record 3-30 s of speech, or pick a saved voice",
                field="voice_id",
            )

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.check(req)
        watch = Stopwatch(req.request_id, req.seed or 0)
        watch.started()
        watch.mark("frontend_done")
        self.active[req.request_id] = cancel = asyncio.Event()
        n = int(self.chunk_s * self.sample_rate)
        try:
            for i in range(self.n_chunks):
                watch.mark("first_chunk_ready")
                watch.mark("first_chunk_started")
                await asyncio.sleep(self.delay_s)
                if cancel.is_set():
                    return
                t = (np.arange(n) + i * n) / self.sample_rate
                pcm = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
                watch.add_tokens(int(self.chunk_s * 25))
                watch.add_audio(self.chunk_s)
                last = i == self.n_chunks - 1
                yield AudioChunk(pcm, self.sample_rate, i, last, watch.snapshot(done=last))
            self.completed += 1
        finally:
            self.active.pop(req.request_id, None)

    async def synthesize(self, req: SynthesisRequest) -> tuple[np.ndarray, AudioChunk]:
        chunks = [c async for c in self.stream(req)]
        return np.concatenate([c.pcm for c in chunks]), chunks[-1]

    def abort(self, request_id: str) -> bool:
        event = self.active.get(request_id)
        if event is None:
            return False
        event.set()
        self.aborted.append(request_id)
        return True

    def stats(self) -> ServerStats:
        return ServerStats(active_streams=len(self.active), completed=self.completed)

    def add_voice(self, name: str, prompt_wav: str, prompt_text: str) -> FakeVoice:
        voice = FakeVoice(id=name, name=name, prompt_text=prompt_text)
        self.voices[voice.id] = voice
        return voice

    def list_voices(self) -> list[FakeVoice]:
        return sorted(self.voices.values(), key=lambda v: v.name)

    def delete_voice(self, voice_id: str) -> None:
        if self.voices.pop(voice_id, None) is None:
            raise NotFound(f"no saved voice {voice_id!r}", field="voice_id")
