"""The reference-style path, built from our modules, for the ratios in BENCHMARKS.md.

What the released CosyVoice code does per request (cli/cosyvoice.py + cli/model.py ``tts``), kept here on
purpose, so the ratio measures what the engine changes:
- the prompt features are recomputed for every request (no cache): speech tokenizer, CAM++, prompt mel;
- the speech LM decodes alone (batch 1, KV cache) in its own thread, appending tokens to a list;
- the consumer sleeps 0.1 s between checks for a ready chunk, then runs flow + HiFT for that one request
  (re-running the flow over all tokens so far, the released hop 25 + pad doubling to 100 schedule; the
  engine's flow reuse is off for it);
- one request at a time: later requests wait for the lock (their queue wait), nothing is batched.
Fixed relative to the release: each request owns its chunk schedule (the release keeps the hop on the
shared model and request N inherits N-1's hop). Same sampler (RAS), same weights and dtypes as the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from bench.load import Recorder
from engine import device as devices
from engine.audio import AudioLimits
from engine.flow.cfm import FlowBatch
from engine.frontend import Frontend, PromptFeatures
from engine.hub import resolve_model
from engine.lm.sampling import SamplerState, sample_step, token_limits
from engine.request import Mode, SynthesisRequest
from engine.serving.streaming import SILENT_TOKENS_V3, ChunkJob, SilenceFilter
from engine.serving.token2wav import Utterance
from engine.vocoder.hift import CausalHiFTGenerator, HiFTGenerator
from engine.vocoder.streaming import V2VocoderState, V3VocoderState

log = logging.getLogger(__name__)

REFERENCE_POLL_S = 0.1  # cli/model.py tts(): time.sleep(0.1) before every check for a ready chunk

Segment = tuple[list[int], list[int], list[int]]  # (text ids, prompt-text ids, prompt speech ids)


@dataclass(eq=False)
class _LMJob:
    """What the LM thread shares with the consumer: the token list it appends to, its end, its error."""

    tokens: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class ReferenceStyle:
    """A bench target (``bench.load.Target``): requests served the reference's way on an engine's weights."""

    name = "baseline"

    def __init__(self, engine: Any, poll_s: float = REFERENCE_POLL_S):
        self.engine, self.poll_s = engine, poll_s
        self.model = engine.model
        self._lock = asyncio.Lock()  # one request at a time; the rest queue here
        files = resolve_model(str(self.model.model_dir))
        limits = AudioLimits.for_prompt(engine.cfg.limits)
        self.frontend = Frontend.from_model_dir(files, self.model.device, limits=limits, cache_size=0)

    async def run(self, req: SynthesisRequest, rec: Recorder) -> None:
        async with self._lock:
            rec.started()
            await asyncio.to_thread(self.synthesize, req, lambda pcm: rec.chunk(len(pcm) / 24000))

    def peak_memory_mb(self) -> float | None:
        return devices.peak_memory_mb(self.model.device)

    def reset_peak_memory(self) -> None:
        devices.reset_peak_memory(self.model.device)

    async def server_ttfa(self) -> tuple[float, int] | None:
        return None  # in process

    # ------------------------------------------------------------------------------- one request (sync)
    def synthesize(self, req: SynthesisRequest, emit: Callable[[np.ndarray], None]) -> None:
        """Run the whole request on this thread (its LM on a second one); ``emit`` gets each pcm chunk."""
        seed = req.seed if req.seed is not None else 0
        features, segments = self._plan(req)
        for i, segment in enumerate(segments):
            self._segment(req, features, segment, seed + i, emit)

    def _plan(self, req: SynthesisRequest) -> tuple[PromptFeatures, list[Segment]]:
        if req.mode not in (Mode.ZERO_SHOT, Mode.CROSS_LINGUAL):
            raise ValueError(f"the baseline runs zero_shot and cross_lingual requests, not {req.mode}")
        source = req.prompt_audio if req.prompt_audio is not None else req.prompt_wav
        if source is None:
            raise ValueError("the baseline needs the request's prompt audio")
        features = self.frontend.extract(source, trim=True)
        text = self.engine.text
        cross = req.mode == Mode.CROSS_LINGUAL
        prompt_ids, speech = [], []
        if not cross:
            prompt_ids = text.tokenize(text.prompt_text(req.prompt_text, req.language, req.text_frontend))
            speech = [int(t) for t in features.speech_tokens]
        parts = text.prepare(req.text, req.language, req.text_frontend, cross_lingual=cross)
        return features, [(text.tokenize(s), prompt_ids, speech) for s in parts]

    def _segment(
        self,
        req: SynthesisRequest,
        features: PromptFeatures,
        segment: Segment,
        seed: int,
        emit: Callable[[np.ndarray], None],
    ) -> None:
        reference = replace(self.engine.cfg.stream, fast_start=False)  # the released schedule
        # the release re-runs the flow over all tokens so far: no frame reuse
        utt = self.engine.token2wav.utterance(
            features, seed, req.stream, schedule=reference, flow_reuse=False
        )
        job = _LMJob(utt.tokens)
        lm = threading.Thread(target=self._decode, args=(req, segment, seed, job), daemon=True)
        lm.start()
        try:
            self._consume(utt, job, req.stream, emit)
        finally:
            lm.join()
        if job.error is not None:
            raise job.error

    # ------------------------------------------------------------------------------------- the LM thread
    def _decode(self, req: SynthesisRequest, segment: Segment, seed: int, job: _LMJob) -> None:
        try:
            with torch.inference_mode():
                self._decode_loop(req, segment, seed, job.tokens)
        except BaseException as err:  # handed to the consumer, which re-raises it
            job.error = err
        finally:
            job.done.set()

    def _decode_loop(self, req: SynthesisRequest, segment: Segment, seed: int, out: list[int]) -> None:
        lm, cfg = self.model.lm, self.engine.cfg.sampling
        text_ids, prompt_ids, speech_ids = (torch.tensor(x, dtype=torch.long) for x in segment)
        weight = lm.speech_embedding.weight
        min_len, max_len = token_limits(len(segment[0]), cfg)
        if req.forced_tokens is not None:
            min_len = max_len = req.forced_tokens
        sampler = SamplerState.seeded(seed, min_len, max_len, tuple(sorted(lm.config.stop_ids)))
        keep = SilenceFilter(SILENT_TOKENS_V3).keep if self.model.family == "cosyvoice3" else None
        cache = lm.new_cache()
        prefix = lm.prefix_embeds(text_ids, prompt_ids, speech_ids)
        hidden = lm.prefill(prefix.to(weight.device, weight.dtype), cache)
        while True:
            tok = sample_step(lm.logprobs(hidden[None]), [sampler], cfg)[0]
            if tok in sampler.stop_ids:
                return
            if keep is None or keep(tok):
                out.append(tok)
            if sampler.finished(tok):
                return
            ids = torch.tensor([tok], device=weight.device)
            hidden = lm.decode(lm.speech_embeds(ids), [cache])[0]

    # ------------------------------------------------------------------------------------- the consumer
    def _consume(self, utt: Utterance, job: _LMJob, stream: bool, emit: Callable[[np.ndarray], None]) -> None:
        """The release's polling loop: sleep, check for a chunk, run it; the final chunk follows the check
        that sees the LM finished without a sleep in between."""
        planner, skip_wait = utt.planner, False
        while True:
            if not skip_wait:
                self._wait(job, stream)
            lm_done = job.done.is_set()  # read before the length: no token can land after "done"
            chunk = planner.next_job(len(job.tokens), lm_done)
            if chunk is None:
                continue
            if chunk.end == 0 or job.error is not None:
                return  # no tokens at all, or the LM failed (re-raised by the caller)
            emit(self._chunk(utt, chunk))
            if chunk.finalize:
                return
            skip_wait = (
                lm_done and len(job.tokens) - planner.offset < planner.this_hop + planner.cfg.lookahead
            )

    def _wait(self, job: _LMJob, stream: bool) -> None:
        if stream:
            time.sleep(self.poll_s)
        else:
            job.done.wait()  # offline: the release joins the LM thread, then runs one finalize pass

    def _chunk(self, utt: Utterance, chunk: ChunkJob) -> np.ndarray:
        """Flow over tokens [0:end) with the prompt, keep the new mel, vocode it with the request's state."""
        dev, flow = self.model.device, self.model.flow
        with torch.inference_mode():
            tokens = torch.tensor(utt.tokens[: chunk.end], dtype=torch.long, device=dev)[None]
            p, feat = utt.prompt_tokens, utt.prompt_feat
            mel = flow.inference(
                FlowBatch.one(tokens, p, feat, utt.embedding),
                streaming=chunk.streaming,
                finalize=chunk.finalize,
            ).float()[:, :, chunk.mel_start :]
            speech = self._vocode(utt, mel, chunk.finalize)
        return speech[0].float().cpu().numpy()

    def _vocode(self, utt: Utterance, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        hift, state = self.model.hift, utt.vocoder
        if isinstance(hift, HiFTGenerator) and isinstance(state, V2VocoderState):
            gen = utt.generator
            return state.step(mel, finalize, lambda m, source: hift.inference(m, source, gen))
        if isinstance(hift, CausalHiFTGenerator) and isinstance(state, V3VocoderState):
            return state.step(mel, finalize, hift.inference)
        raise TypeError(f"vocoder state {type(state).__name__} does not fit {type(hift).__name__}")
