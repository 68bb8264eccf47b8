"""Speech tokens -> waveform: flow matching then HiFT, run by one worker thread per device.

Every request keeps its own ``Utterance`` (prompt conditioning, chunk planner, vocoder continuation); the
worker takes chunk jobs from all active requests, in arrival order, so GPU work is serialised by one owner
we time instead of interleaving threads. ``run`` is awaited by the request's coroutine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import StreamConfig
from engine.errors import SynthesisFailed
from engine.frontend import PromptFeatures
from engine.models.flow import Flow
from engine.models.hift import CausalHiFTGenerator, HiFTGenerator
from engine.streaming import ChunkJob, ChunkPlanner, V2VocoderState, V3VocoderState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Utterance:
    """One segment's token2wav state, owned by its request."""

    prompt_tokens: torch.Tensor  # [1, P] long
    prompt_feat: torch.Tensor  # [1, 2P, 80]
    embedding: torch.Tensor  # [1, 192]
    planner: ChunkPlanner
    vocoder: V2VocoderState | V3VocoderState
    generator: torch.Generator | None  # v2 HiFT's noise, per request
    speed: float = 1.0
    tokens: list[int] = field(default_factory=list)
    stage_s: dict[str, float] = field(default_factory=lambda: {"flow": 0.0, "hift": 0.0})


@dataclass(eq=False)
class _Job:
    utt: Utterance
    chunk: ChunkJob
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[np.ndarray]


class Token2Wav:
    def __init__(
        self,
        flow: Flow,
        hift: HiFTGenerator | CausalHiFTGenerator,
        family: str,
        device: torch.device,
        stream_cfg: StreamConfig,
        flow_dtype: torch.dtype = torch.float32,
    ):
        self.flow, self.hift, self.family, self.device = flow, hift, family, device
        self.stream_cfg, self.flow_dtype = stream_cfg, flow_dtype
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.pending = 0
        self._thread = threading.Thread(target=self._loop, name="token2wav", daemon=True)
        self._thread.start()

    def utterance(self, features: PromptFeatures, seed: int, stream: bool, speed: float = 1.0) -> Utterance:
        """Fresh per-segment state; ``features`` carries the (trimmed) prompt tokens/mel/embedding."""
        dev = self.device
        # copies: cached features are shared, read-only arrays
        tokens = torch.tensor(features.speech_tokens, dtype=torch.long, device=dev)[None]
        feat = torch.tensor(features.prompt_mel, dtype=torch.float32, device=dev)[None]
        emb = torch.tensor(features.speaker_embedding, dtype=torch.float32, device=dev)[None]
        planner = ChunkPlanner(tokens.shape[1], self.stream_cfg, stream=stream)
        if self.family == "cosyvoice2":
            gen = torch.Generator(device=dev).manual_seed(seed)
            return Utterance(tokens, feat, emb, planner, V2VocoderState(self.stream_cfg), gen, speed)
        return Utterance(tokens, feat, emb, planner, V3VocoderState(), None, speed)

    async def run(self, utt: Utterance, chunk: ChunkJob) -> np.ndarray:
        """Compute one chunk's new audio: float32 [samples] at 24 kHz."""
        loop = asyncio.get_running_loop()
        job = _Job(utt, chunk, loop, loop.create_future())
        self.pending += 1
        self._jobs.put(job)
        return await job.future

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.pending -= 1
            if job.future.cancelled():
                continue  # its request went away while it waited
            try:
                with torch.inference_mode():
                    pcm = self._compute(job.utt, job.chunk)
                job.loop.call_soon_threadsafe(_resolve, job.future, pcm, None)
            except Exception as err:  # the request fails, the worker keeps serving
                log.exception("token2wav job failed")
                job.loop.call_soon_threadsafe(_resolve, job.future, None, err)

    def _compute(self, utt: Utterance, chunk: ChunkJob) -> np.ndarray:
        t0 = time.perf_counter()
        mel = self._flow(utt, chunk)[:, :, chunk.mel_start :]
        t1 = time.perf_counter()
        speech = self._vocode(utt, mel, chunk.finalize)
        pcm = speech[0].float().cpu().numpy()
        utt.stage_s["flow"] += t1 - t0
        utt.stage_s["hift"] += time.perf_counter() - t1
        if not np.isfinite(pcm).all():
            raise SynthesisFailed("the vocoder produced non-finite audio; this request was stopped")
        return pcm

    def _vocode(self, utt: Utterance, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        hift, voc = self.hift, utt.vocoder
        if isinstance(hift, HiFTGenerator) and isinstance(voc, V2VocoderState):
            gen = utt.generator

            def v2(m: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return hift.inference(m, source, gen)

            return voc.step(mel, finalize, v2, utt.speed)
        if isinstance(hift, CausalHiFTGenerator) and isinstance(voc, V3VocoderState):
            return voc.step(mel, finalize, hift.inference, utt.speed)
        raise TypeError(f"vocoder state {type(voc).__name__} does not fit {type(hift).__name__}")

    def _flow(self, utt: Utterance, chunk: ChunkJob) -> torch.Tensor:
        tokens = torch.tensor(utt.tokens[: chunk.end], dtype=torch.long, device=self.device)[None]
        p = utt.prompt_tokens
        return self.flow.inference(
            token=tokens,
            token_len=torch.tensor([tokens.shape[1]], device=self.device),
            prompt_token=p,
            prompt_token_len=torch.tensor([p.shape[1]], device=self.device),
            prompt_feat=utt.prompt_feat,
            prompt_feat_len=torch.tensor([utt.prompt_feat.shape[1]], device=self.device),
            embedding=utt.embedding,
            streaming=chunk.streaming,
            finalize=chunk.finalize,
        ).float()


def _resolve(future: asyncio.Future[np.ndarray], value: np.ndarray | None, err: BaseException | None) -> None:
    if future.done():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(value)  # type: ignore[arg-type]
