"""TTSEngine: one resident model, many concurrent streaming requests.

``stream(request)`` is the primitive: it validates, waits for a slot (bounded queue), computes the prompt
features, then for each text segment decodes speech tokens on the LM backend and turns them into audio
chunk by chunk on the token2wav worker. ``synthesize`` concatenates the stream. All per-request state lives
in the generator's locals and the objects it owns; its ``finally`` aborts the LM request and frees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from engine import device as devices
from engine.asr import LoadingAsr, Transcript, model_choice
from engine.audio import AudioInput, AudioLimits
from engine.cache_root import cache_root, configured_root, use_cache_root
from engine.checkpoint import LoadedModel, load_model
from engine.config import AUTO_POOL_SHARE, DEMO_TINY, EngineConfig
from engine.errors import InvalidInput, NotReady, Stopping, SynthesisFailed
from engine.flow.cfm import CausalCFM
from engine.flow.compiled_estimator import use_compile_cache
from engine.flow.graphs import AotRoot, GraphedCFM
from engine.frontend import Frontend, PromptFeatures
from engine.graph_builder import GraphBuilder
from engine.hub import ModelDir, resolve_model
from engine.import_lock import transformers_import
from engine.lexicons import LexiconLibrary
from engine.lm import fork_server
from engine.lm.backend import LMBackend, LMRequest
from engine.lm.bistream import Interleaver, Layout, bistream_tokens
from engine.lm.decode_slot import DecodeSlot
from engine.lm.handover import HandoverLM, StartGate
from engine.lm.prompt_table import PromptTable
from engine.lm.sampling import token_limits
from engine.lm.speech_lm import SpeechLM
from engine.request import AudioChunk, Mode, SynthesisRequest
from engine.serving.admission import Admission
from engine.serving.first_lane import open_lane
from engine.serving.first_lane import refusal as lane_refusal
from engine.serving.job_queue import FirstChunk
from engine.serving.kept_prompts import PromptTensors
from engine.serving.metrics import ServerStats, Stopwatch
from engine.serving.pauses import has_pauses, with_pauses
from engine.serving.plan import Plan, Planner
from engine.serving.playback import Playback
from engine.serving.startup import Timeline
from engine.serving.streaming import MEL_FRAMES_PER_S, SILENT_TOKENS_V3, SilenceFilter
from engine.serving.subtitles import WordTimer
from engine.serving.switch_interval import switch_interval
from engine.serving.token2wav import Token2Wav, Utterance
from engine.text.frontend import TextFrontend, instruct_presets, load_tokenizer
from engine.text.pool import TextPool, text_job
from engine.text.stream import Prefetch, text_pieces, token_pieces
from engine.vocoder.graphs import GraphedHiFT
from engine.vocoder.hift import CausalHiFTGenerator
from engine.voices import ExampleVoice, Voice, VoiceLibrary, load_examples

if TYPE_CHECKING:
    from engine.lm.lm_host import HostedLM
    from engine.lm.vllm_backend import VLLMBackend

log = logging.getLogger(__name__)
T = TypeVar("T")
# A background capture (``GraphBuilder``: seconds of the interpreter beside the serving threads) goes
# ahead with the engine idle, or with every stream in it holding this much audio in its client's buffer
# (s), longer than a capture takes: then the capture can slow its next chunks, not make it stall
CAPTURE_SLACK_S = 3.0
CAPTURE_RECHECK_S = 0.25  # a waiting capture looks at the buffers again this often (they grow on delivery)
# what vLLM holds on the device beside a fixed KV cache (GiB): the 0.5B LM's weights 0.7, its CUDA graphs
# 0.13 and the activations of a 2048-token step (the H200's logs), with room for the CUDA context
LM_BESIDE_KV_GIB = 2.0


@dataclass(eq=False)
class _Active:
    """A running request, reachable by ``abort``; owned by its generator."""

    request_id: str
    cancelled: threading.Event = field(default_factory=threading.Event)  # set by abort(), any thread
    # when the audio delivered so far runs out: each chunk's token2wav deadline
    playback: Playback = field(default_factory=lambda: Playback(time.perf_counter))
    text: Prefetch | None = None  # a streamed text: ended by abort, so a decode waiting for text stops too
    # its first chunk being decoded (the token2wav worker's quiet-first hold counts it), from its first LM
    # segment's start until that chunk is queued or the segment ends however it ends
    first: FirstChunk | None = None


class TTSEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        model: LoadedModel,
        frontend: Frontend,
        text: TextFrontend,
        backend: LMBackend,
        voices: VoiceLibrary,
        hift_graphs: GraphedHiFT | None = None,
        text_pool: TextPool | None = None,
        asr: LoadingAsr | None = None,
    ):
        self.cfg, self.model, self.frontend, self.text = cfg, model, frontend, text
        self.text_pool = text_pool or TextPool(text, 0)
        self.backend, self.voices, self.asr = backend, voices, asr
        self.family, self.sample_rate = model.family, 24000
        self.lexicons = LexiconLibrary(voices.root, model.family)  # beside the voices, same owners
        self.model_name = str(model.model_dir.name)
        self.planner = Planner(frontend, text, voices, model.family, cfg.limits)
        self._active: set[_Active] = set()  # the worker's thin signal reads it
        self.token2wav = Token2Wav(
            model.flow, model.hift, model.family, model.device, cfg.stream, cfg.flow_batch,
            cfg.t2w_own_stream, hift_graphs, getattr(model.flow.decoder, "frame_bucket", 100),
            fifo=cfg.t2w_fifo, relaxed_cap=cfg.t2w_relaxed_cap, thin=self._thin_stream,
            yield_to_urgent=cfg.t2w_yield_to_urgent, quiet_first=cfg.t2w_quiet_first,
            reuse_gb=cfg.flow_reuse_gb,
            flow_reuse=cfg.reuses_flow(model.family, graphed=isinstance(model.flow.decoder, GraphedCFM)),
            voice_pages=cfg.flow_voice_pages, kept_prompts=cfg.t2w_kept_prompts,
        )  # fmt: skip
        self.token2wav.lane_urgent = cfg.t2w_lane_priority  # read by the first-chunk lane, where one opens
        # the LM's embedding rows on the host (bench --ab host-prefix builds them for both arms, switches use)
        self.prompt_table = PromptTable.of(model.lm) if cfg.lm_host_prefix else None
        self.host_prefix = cfg.lm_host_prefix
        self.prompt_in_frontend = cfg.t2w_prompt_in_frontend  # bench --ab prompt-in-frontend switches it
        self.admission = Admission(
            cfg.limits.max_concurrency,
            cfg.limits.max_queue,
            self._least_slack_s,
            cfg.limits.admit_slack_s,
        )
        self._ended: str | None = None  # end_streams' reason: streams stopped by it fail with Stopping
        self._counts = {"completed": 0, "failed": 0, "cancelled": 0, "audio_s": 0.0, "tokens": 0}
        self.ready = False
        self._settings = contextlib.ExitStack()  # process-wide settings held while open (load: cudnn)
        self.startup = Timeline()  # load() passes the one its phases went on
        self.graph_builder = GraphBuilder(self.startup)  # load() passes the one holding the later graphs
        self._lm_gate: StartGate | None = None  # the LM backend's start, held until warmup (load sets it)

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(
        cls,
        cfg: EngineConfig,
        model_dir: str | Path | None = None,
        timeline: Timeline | None = None,
        idle_work: Sequence[tuple[str, Callable[[], object]]] = (),
    ) -> TTSEngine:
        """Resolve/download the checkpoint, load it strictly onto the device, start the workers; each
        phase goes on ``timeline`` (a fresh one from this process's launch if None). ``idle_work``: named
        jobs of the caller's (the server's studio import) run on the loading thread while it would only
        wait for the LM backend's start (vLLM: tens of seconds), each a phase; those left when the backend
        is up are skipped (the caller then does them later)."""
        timeline = timeline or Timeline()
        use_cache_root(cache_root(cfg.cache_dir))  # before anything compiles or vLLM reads its variables
        if cfg.model == DEMO_TINY and model_dir is None:  # the tiny random-weight model, built offline once
            from engine.demo.make_model import demo_tiny

            with timeline.phase("demo model"):
                cfg, model_dir = demo_tiny(cfg)
        with timeline.phase("model files"):
            root = configured_root(cfg.cache_dir)  # else the hub's own cache (HF_HOME, MODELSCOPE_CACHE)
            files = resolve_model(str(model_dir or cfg.model), str(root) if root else None, cfg.llm_variant)
        # process-wide settings the engine holds until close(), undone here if loading fails
        with contextlib.ExitStack() as settings:
            mps = settings.enter_context(_cuda_mps(cfg))  # before anything here initialises CUDA
            settings.enter_context(switch_interval(cfg.gil_switch_ms))
            # under MPS our context comes now, at its SM share, before vLLM's engine core starts with all
            dev = (
                devices.resolve(cfg.device)
                if mps is None
                else mps.connect(cfg.device, cfg.mps_flow_percent, cfg.mps_flow_below_normal)
            )
            devices.configure(dev)
            if cfg.flow_attention == "cudnn":  # before the flow compiles and captures: they fix the kernel
                settings.enter_context(devices.cudnn_attention(dev))
            engine = cls._assemble(cfg, files, dev, timeline, idle_work)
            if mps is not None:  # this process and vLLM's engine core have initialised CUDA by now
                mps.check_serving()
            engine._settings = settings.pop_all()
        return engine

    @classmethod
    def _assemble(
        cls,
        cfg: EngineConfig,
        files: ModelDir,
        dev: torch.device,
        timeline: Timeline,
        idle_work: Sequence[tuple[str, Callable[[], object]]] = (),
    ) -> TTSEngine:
        """Load the checkpoint onto ``dev``, build the solver, frontends and backend, start the workers.
        The weights load on a thread of their own from the start. The LM backend (vLLM's start: about a
        minute on a GPU) starts in a thread right after the tokenizer, from llm.pt (or its cached export),
        while the weights finish loading, then the prompt frontend and the voices; Whisper and the graphs
        come after it (it sizes its KV cache from the memory free at its start), the first graph of each
        kind now and the rest behind a serving engine (``graph_builder``, started by ``warmup``; where
        ready waits for vLLM, begun in that wait). With a handover (``EngineConfig.lm_handover``, on by
        default) the load does not wait for vLLM: the native loop serves until vLLM is up
        (``engine.lm.handover``)."""
        _start_fork_server(cfg, dev)
        # the text workers first: separate processes, each importing for seconds (10 s of the path to ready
        # on an H200 when they started after the frontends and the LM did not hide them: the handover)
        early = _started_pool(cfg, files, dev)
        weights = _loading(cfg, files, dev, timeline)
        builder = GraphBuilder(timeline)
        try:
            return cls._assemble_beside(cfg, files, dev, idle_work, early, weights, builder)
        except BaseException:
            builder.stop()  # where it began beside vLLM's start, no capture outlives a failed load
            wait([weights])  # nor a loading thread
            if early is not None:
                early.close()
            raise

    @classmethod
    def _assemble_beside(
        cls,
        cfg: EngineConfig,
        files: ModelDir,
        dev: torch.device,
        idle_work: Sequence[tuple[str, Callable[[], object]]],
        early: TextPool | None,
        weights: Future[LoadedModel],
        builder: GraphBuilder,
    ) -> TTSEngine:
        """``_assemble`` once the text workers (``early``: None where there are none) are starting and the
        weights loading (``weights``); ``builder`` takes the graphs past the first (its timeline is the
        load's)."""
        timeline = builder.timeline
        # the tokenizer (tokenizers alone, ~0.1-0.5 s), then the LM's start: vLLM's import (transformers with
        # it, seconds of Python) now runs beside the weights, which map their files without a host copy.
        # When the weights were still unpickled beside vLLM's start, both ran slower (BENCHMARKS.md,
        # "Start-up", 5837804): whether the mapped weights avoid that is for the next GPU run to say
        with timeline.phase("tokenizer"):
            text = TextFrontend(load_tokenizer(files.qwen, files.family))
        handover = cfg.hands_over and _uses_vllm(cfg, devices.is_accelerator(dev))
        # with a handover the LM's start may wait for the engine's ready (warmup opens the gate)
        gate = StartGate() if handover and cfg.lm_start_after_ready else None
        starter = ThreadPoolExecutor(1, thread_name_prefix="lm-start")
        try:
            lm: tuple[object, ...] = (cfg, files, dev, weights.result)
            started = starter.submit(_started_lm, gate, timeline, *lm)
            try:
                loads = (cfg, files, dev, timeline, text, weights, builder, early)
                model, vocoder, parts = _beside_the_lm(*loads)
            except BaseException:
                if gate is not None:  # the held start ends at once, starting nothing
                    gate.cancel()
                if started.exception() is None:  # the load fails: the started backend goes with it
                    started.result().close()
                raise
            if _builds_while_lm_starts(cfg, dev, handover):
                builder.begin()
            # the caller's idle work (the studio's import) still beside vLLM's start with a handover: the
            # studio is then built before ready, not beside the first requests
            for name, work in idle_work:
                if started.done():
                    break
                _timed(timeline, name, work)
            backend: LMBackend
            if handover:  # the native loop serves now; vLLM takes new requests once up (engine.lm.handover)
                backend = _handover(model, cfg, dev, started, timeline, gate)
            else:
                backend = started.result()
        finally:
            starter.shutdown(wait=not handover)  # a handover's vLLM start goes on behind the serving engine
        with timeline.phase("text workers"):  # what is left of their start (seconds) once the LM is up
            _or_close(parts.pool.wait_started, backend.close)  # the pool: closed by _assemble
        asr_name = model_choice(cfg.asr_model, dev)
        # Whisper loads beside the first graphs and the warm-up, not before ready: only a prompt without its
        # transcript needs it, and such a request waits for it (after vLLM's start, which sizes its KV cache
        # from the device memory free then)
        asr = LoadingAsr.start(asr_name, dev, timeline) if asr_name else None
        if not _graphs_early(cfg, dev):
            # after vLLM has taken its share of device memory: it sizes its KV cache from what is free at
            # its start, so graphs captured first could leave it too little (seen on the H200: 24 GiB free);
            # with a handover vLLM may still be starting: the pool leaves it its share
            share = _lm_share(cfg, dev) if handover else 0.0
            _first_graphs(model, vocoder, cfg, dev, builder, lm_share=share)
        log.info("loaded %s (%s) on %s with the %s LM backend", files.root, model.family, dev, backend.name)
        p = parts
        engine = cls(cfg, model, p.frontend, p.text, backend, p.voices, vocoder, p.pool, asr)
        engine.startup, engine.graph_builder, engine._lm_gate = timeline, builder, gate
        if cfg.opens_first_lane(devices.graphs_supported(dev)):
            engine._first_lane(vocoder, dev, builder)
        return engine

    def _first_lane(self, vocoder: GraphedHiFT | None, dev: torch.device, builder: GraphBuilder) -> None:
        """EngineConfig.t2w_first_lane: with background graphs, the lane's graphs are the builder's last
        job (of the solver serving by then) and it opens after them; else its graphs now, and it opens."""
        if (why := lane_refusal(self.model.flow, dev)) is not None:
            # asked for (True): a warning; auto: what it would have needed, for whoever reads the log
            log.log(logging.WARNING if self.cfg.t2w_first_lane else logging.INFO, "%s: not opened", why)
            return
        frames = int(max(self.cfg.graph_warmup_s, 0.0) * MEL_FRAMES_PER_S)
        parts = (self.token2wav, self.model.flow, vocoder, frames, dev)
        if self.cfg.background_graphs and isinstance(self.model.flow.decoder, GraphedCFM):
            builder.add("first-chunk lane graphs", lambda stop: open_lane(*parts, stop))
        else:
            open_lane(*parts)

    async def warmup(self) -> None:
        """One short synthesis so the first user does not pay for lazy initialisation."""
        rng = np.random.default_rng(0)
        prompt = (0.1 * rng.standard_normal(24000 * 3)).astype(np.float32), 24000
        req = SynthesisRequest(text="Hello.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=0)
        self.ready = True  # warmup itself goes through the normal path
        with self.startup.phase("warm-up"):
            async for _ in self.stream(req):
                pass
        if self.cfg.ready_graph_wait_s > 0:
            await self._graphs_before_ready(self.cfg.ready_graph_wait_s)
        self.startup.mark_ready()
        if self._lm_gate is not None:  # EngineConfig.lm_start_after_ready: vLLM's start from now on
            self._lm_gate.open()
        self.graph_builder.yield_to(self._capture_clear)  # captured where no stream can stall for it
        self.graph_builder.start()  # the remaining graphs, behind the requests that now run

    async def _graphs_before_ready(self, wait_s: float) -> None:
        """EngineConfig.ready_graph_wait_s: the builder's jobs run now (unpaced: nothing is served yet), ready
        waiting for them ``wait_s`` at most; what is left then goes on behind the requests, paced."""
        self.graph_builder.start()  # no job comes after the load: the queue is sealed, the thread begun
        with self.startup.phase("graphs before ready"):
            done = await asyncio.to_thread(self.graph_builder.wait, wait_s)
        if not done:
            left = self.startup.pending()
            log.info("ready after %.1f s of background graphs; still to run: %s", wait_s, ", ".join(left))

    def close(self) -> None:
        self.ready = False
        self.graph_builder.stop()
        self.backend.close()
        self.token2wav.close()
        self.text_pool.close()
        self._settings.close()

    # ------------------------------------------------------------------ public surface
    def split_preview(self, text: str, language: str = "auto") -> list[str]:
        """The normalised segments ``stream`` would speak one after another (for the UI's preview)."""
        return self.text.prepare(text, language) if text.strip() else []

    def instruct_presets(self) -> list[str]:
        return [p.instruct for p in instruct_presets(self.family)]

    def abort(self, request_id: str) -> bool:
        for active in list(self._active):
            if active.request_id == request_id:
                active.cancelled.set()
                if active.text is not None:
                    active.text.end()
                return True
        return False

    def end_streams(self, reason: str) -> int:
        """Stop every stream in flight within a chunk (the server is going away): each fails with
        Stopping(reason) (a NotReady), so its client gets an error, not a silent end; new requests get it
        at once.
        Returns how many were in flight."""
        self._ended = reason
        active = list(self._active)
        for each in active:
            each.cancelled.set()
            if each.text is not None:
                each.text.end(Stopping(reason, retry_after_s=5.0))
        return len(active)

    def stats(self) -> ServerStats:
        dev = self.model.device
        return ServerStats(
            active_streams=self.admission.active,
            queued=self.admission.queued,
            completed=int(self._counts["completed"]),
            failed=int(self._counts["failed"]),
            cancelled=int(self._counts["cancelled"]),
            audio_s_total=float(self._counts["audio_s"]),
            lm_tokens_total=int(self._counts["tokens"]),
            device_memory_mb=devices.memory_mb(dev),
            device=str(dev),
        )

    async def synthesize(self, req: SynthesisRequest) -> tuple[np.ndarray, AudioChunk]:
        """The whole utterance: the concatenated stream and its last chunk (final metrics)."""
        parts, last = [], None
        async for chunk in self.stream(req):
            parts.append(chunk.pcm)
            last = chunk
        assert last is not None
        return np.concatenate(parts), last

    def _capture_clear(self, timeout_s: float) -> bool:
        """The graph builder's pace: wait, ``timeout_s`` at most, until a background capture can make no
        stream stall (the engine idle, or every stream's buffer at ``CAPTURE_SLACK_S``) -> True then,
        False when the bound passed first."""
        deadline = time.monotonic() + timeout_s
        while not self._streams_buffered(CAPTURE_SLACK_S):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.admission.wait_idle(min(left, CAPTURE_RECHECK_S)):  # wakes at once when the last ends
                return True
        return True

    def _streams_buffered(self, least_s: float) -> bool:
        """Every stream in the engine (waiting, computing or playing) has ``least_s`` of audio buffered at
        its client, or all of its audio delivered; True with none."""
        return all(a.playback.finished or a.playback.buffered_s() >= least_s for a in list(self._active))

    def _thin_stream(self) -> bool:
        """The relaxed rule's auto signal (the token2wav worker asks before each batch): a stream in the
        engine, waiting for its first audio or playing, has under ``relaxed_slack_s`` of audio buffered
        and more to come, so a long call of chunks with slack to spare could make it wait."""
        return not self._streams_buffered(self.cfg.stream.relaxed_slack_s)

    def _least_slack_s(self) -> float | None:
        """Admission's load signal: how close the admitted streams are to running dry (s): the least slack
        of the chunks waiting for the token2wav worker and of the playing clients' buffers (None: nothing
        is playing or waiting)."""
        slacks = [a.playback.slack_s() for a in list(self._active)] + [self.token2wav.least_slack_s()]
        return min((s for s in slacks if s is not None), default=None)

    @property
    def lm_backend(self) -> str:
        """The LM backend new requests go to (with a handover: native while vLLM starts, then vllm)."""
        return self.backend.name

    @property
    def healthy(self) -> bool:
        """Both workers can still compute: False means only a restart helps (the API's /health says so)."""
        return self.backend.healthy and self.token2wav.healthy

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """The request's audio chunks; a text with ``<break/>`` tags is spoken piece by piece around them
        (``engine.serving.pauses``), checked whole first."""
        if not has_pauses(req):
            async with contextlib.aclosing(self._stream(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        self.planner.check(req)
        async with contextlib.aclosing(with_pauses(self._stream, req, self.sample_rate)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _stream(self, req: SynthesisRequest) -> AsyncGenerator[AudioChunk, None]:
        if self._ended is not None:
            raise Stopping(self._ended, retry_after_s=5.0)
        if not self.ready:
            raise NotReady("the model is still loading", retry_after_s=5.0)
        if not self.healthy:
            log.error(
                "refusing a request: the %s LM backend or the token2wav worker has stopped", self.backend.name
            )
            raise NotReady("the speech engine has stopped; the server needs a restart", retry_after_s=30.0)
        self.planner.check(req)
        seed = req.seed if req.seed is not None else random.randrange(2**31)
        watch = Stopwatch(req.request_id, seed)
        # a streamed text is read as it arrives, from now on: its first piece starts the TTFA clock
        limit = self.cfg.limits.max_text_chars
        prefetch = Prefetch(req.text_stream, watch.first_text, limit) if req.text_stream is not None else None
        active = _Active(req.request_id, text=prefetch)
        self._active.add(active)
        try:
            await self.admission.acquire(self.cfg.limits.request_timeout_s)
            admitted = time.perf_counter()
            try:
                if not active.cancelled.is_set():  # aborted while it waited in line: nothing to compute
                    # closed explicitly, down the chain to the LM request: a caller that leaves aborts
                    # its decode now, not when the garbage collector finalises the inner generators
                    async with contextlib.aclosing(self._run(req, seed, watch, active, prefetch)) as run:
                        async for chunk in run:
                            yield chunk
            finally:
                self.admission.release(time.perf_counter() - admitted)
            if active.cancelled.is_set() and self._ended is not None:
                raise Stopping(self._ended, retry_after_s=5.0)
            self._counts["cancelled" if active.cancelled.is_set() else "completed"] += 1
        except (GeneratorExit, asyncio.CancelledError):  # the caller went away: not a failure
            self._counts["cancelled"] += 1
            raise
        except BaseException:
            self._counts["failed"] += 1
            raise
        finally:
            if prefetch is not None:
                await prefetch.aclose()
            self._active.discard(active)
            self._counts["audio_s"] += watch.audio_s
            self._counts["tokens"] += watch.lm_tokens

    # ------------------------------------------------------------------ one request
    async def _run(
        self, req: SynthesisRequest, seed: int, watch: Stopwatch, active: _Active, prefetch: Prefetch | None
    ) -> AsyncGenerator[AudioChunk, None]:
        watch.started()
        t0 = time.perf_counter()
        plan = await self._plan(req)
        watch.add_stage("frontend", time.perf_counter() - t0)
        watch.mark("frontend_done")
        index = 0
        deadline = time.monotonic() + self.cfg.limits.request_timeout_s
        audio = (
            self._audio(req, plan, seed, watch, active)
            if prefetch is None
            else self._live(req, plan, seed, watch, active, prefetch)
        )
        async with contextlib.aclosing(audio):
            async for pcm in audio:
                if time.monotonic() > deadline:
                    limit = self.cfg.limits.request_timeout_s
                    raise SynthesisFailed(f"request took longer than {limit:.0f} s")
                seconds = len(pcm) / self.sample_rate
                watch.add_audio(seconds)
                active.playback.delivered(seconds)
                trace = watch.chunk_sent(seconds)
                yield AudioChunk(pcm, self.sample_rate, index, False, watch.snapshot(), trace)
                index += 1
        active.playback.finished = True
        if not active.cancelled.is_set():
            yield AudioChunk(
                np.zeros(0, np.float32), self.sample_rate, index, True, watch.snapshot(done=True)
            )

    async def _plan(self, req: SynthesisRequest) -> Plan:
        """Prompt features in a thread (ONNX and numpy release the GIL; the prompt cache is shared), then
        the text in the text pool: neither runs on the event loop, and requests do not queue on the GIL."""
        if req.mode == Mode.VC:
            return await asyncio.to_thread(self._vc_plan, req)
        prompt, transcript, tensors = await asyncio.to_thread(self._prompt, req)
        if req.text_stream is not None:  # its text comes later, in pieces: the prompt part now
            plan = await asyncio.to_thread(self.planner.stream_plan, req, prompt, transcript)
        else:
            plan = self.planner.assemble(req, prompt, await self.text_pool.run(text_job(req, transcript)))
        return replace(plan, flow_tensors=tensors)

    def _prompt(self, req: SynthesisRequest) -> tuple[PromptFeatures, str, PromptTensors | None]:
        """The planner's prompt and transcript, and its flow tensors where made here (``_flow_tensors``)."""
        prompt, transcript = self.planner.prompt(req)
        return prompt, transcript, self._flow_tensors(prompt)

    def _vc_plan(self, req: SynthesisRequest) -> Plan:
        plan = self.planner.vc_plan(req)
        return replace(plan, flow_tensors=self._flow_tensors(plan.flow_prompt))

    def _flow_tensors(self, features: PromptFeatures) -> PromptTensors | None:
        """EngineConfig.t2w_prompt_in_frontend: the flow's prompt on the device, made in this (the
        frontend's) thread, so the event loop makes no blocking copy when the audio starts; else None."""
        return self.token2wav.prompts.get(features) if self.prompt_in_frontend else None

    async def _audio(
        self, req: SynthesisRequest, plan: Plan, seed: int, watch: Stopwatch, active: _Active
    ) -> AsyncGenerator[np.ndarray, None]:
        stream = req.streams_audio
        schedule = replace(
            self.cfg.stream,
            fast_start=self._splits_first_chunk(watch),
            adaptive_hop=self.cfg.stream.adapts_hops(self.family, self.admission.active),
        )
        if plan.source_tokens is not None:
            utt = self.token2wav.utterance(
                plan.flow_prompt, seed, stream, req.speed, schedule, tensors=plan.flow_tensors
            )
            utt.tokens.extend(plan.source_tokens)
            async for pcm in self._drain(utt, True, active, watch):
                yield pcm
            return
        for i, (text_ids, prompt_ids, speech_ids) in enumerate(plan.segments):
            utt = self.token2wav.utterance(
                plan.flow_prompt, seed + i, stream, req.speed, schedule, tensors=plan.flow_tensors
            )
            watch.flow_prompt_made()
            segment = self._segment(req, utt, text_ids, prompt_ids, speech_ids, seed + i, watch, active)
            async with contextlib.aclosing(segment):
                async for pcm in segment:
                    yield pcm
            if active.cancelled.is_set():
                return

    def _splits_first_chunk(self, watch: Stopwatch) -> bool:
        """StreamConfig.splits_first_chunk at the engine's load now (requests computing, and with
        ``fast_start_burst_s`` those that started within it), noted in ``watch`` for the trace."""
        stream = self.cfg.stream
        burst = stream.fast_start_burst_s
        recent = None if burst is None else self.admission.started_within(burst, time.perf_counter())
        watch.load_at_start(self.admission.active, recent)
        return stream.splits_first_chunk(self.admission.active, recent)

    async def _segment(
        self,
        req: SynthesisRequest,
        utt: Utterance,
        text_ids: list[int],
        prompt_ids: list[int],
        speech_ids: list[int],
        seed: int,
        watch: Stopwatch,
        active: _Active,
    ) -> AsyncGenerator[np.ndarray, None]:
        lm = self.model.lm
        watch.add_text_tokens(len(text_ids))  # the usage's input tokens
        prefix = await self._prompt_embeds(text_ids, prompt_ids, speech_ids)
        watch.prefix_made()
        min_len, max_len = token_limits(len(text_ids), self.cfg.sampling)
        if req.forced_tokens is not None:  # fixed compute for benchmarks: no stop before, none after
            min_len = max_len = req.forced_tokens
        urgent = active.playback.buffered_s() <= 0.0  # nothing left to play: this listener is waiting
        lm_req = LMRequest(
            f"{req.request_id}:{seed}",
            prefix,
            seed,
            min_len,
            max_len,
            tuple(sorted(lm.config.stop_ids)),
            LMRequest.URGENT if urgent else LMRequest.BUFFERED,
        )
        first = self._first_chunk(active, req.streams_audio)
        try:
            async with contextlib.aclosing(
                self._speak(utt, self.backend.generate(lm_req), watch, active)
            ) as audio:
                async for pcm in audio:
                    yield pcm
        finally:  # done, failed, aborted or left: a ticket left open would hold the worker's calls
            if first is not None:
                first.end()

    async def _prompt_embeds(
        self, text_ids: list[int], prompt_ids: list[int], speech_ids: list[int]
    ) -> torch.Tensor:
        """The LM's prompt embeddings [P, H]: gathered from the host's copy of its tables here on the event
        loop (EngineConfig.lm_host_prefix: ~100 rows, microseconds, nothing waits on the device), else looked
        up on the LM's device in a thread (device work: off the event loop)."""
        if self.host_prefix and self.prompt_table is not None:
            return self.prompt_table.prefix(text_ids, prompt_ids, speech_ids)
        return await asyncio.to_thread(_prefix, self.model.lm, text_ids, prompt_ids, speech_ids)

    def _first_chunk(self, active: _Active, stream: bool) -> FirstChunk | None:
        """The request's first-chunk ticket, taken as its first LM segment starts (None for later ones).
        Only a streamed answer's: a whole-file answer's first chunk is all its tokens (seconds of decode,
        through which the worker would idle in holds). A streamed text's decode (``_live``) takes none
        either: it waits on the client's words, not on the GPU."""
        if active.first is not None or not stream:
            return None
        active.first = self.token2wav.first_chunk()
        return active.first

    async def _live(
        self, req: SynthesisRequest, plan: Plan, seed: int, watch: Stopwatch, active: _Active, text: Prefetch
    ) -> AsyncGenerator[np.ndarray, None]:
        """Text-streaming input: one bistream decode over the pieces as they arrive (lm/bistream.py)."""
        stream = req.streams_audio
        schedule = replace(self.cfg.stream, fast_start=self._splits_first_chunk(watch))
        utt = self.token2wav.utterance(
            plan.flow_prompt, seed, stream, req.speed, schedule, tensors=plan.flow_tensors
        )
        _, prompt_ids, speech_ids = plan.segments[0]
        interleaver = Interleaver(Layout.of(self.model.lm.config), prompt_ids, speech_ids)
        limits = self.cfg.limits
        pieces = text_pieces(self.text, req.language, req.text_frontend, limits.max_text_chars)
        ids = counted(token_pieces(text.pieces(), pieces, self.text.tokenize, limits.text_idle_s), watch)
        session = self.backend.session(f"{req.request_id}:{seed}", seed)
        try:
            tokens = bistream_tokens(session, interleaver, ids, self.cfg.sampling, req.forced_tokens)
            async with contextlib.aclosing(self._speak(utt, tokens, watch, active)) as audio:
                async for pcm in audio:
                    yield pcm
        finally:
            await session.aclose()

    async def _speak(
        self, utt: Utterance, tokens: AsyncIterator[int], watch: Stopwatch, active: _Active
    ) -> AsyncGenerator[np.ndarray, None]:
        """Speech tokens as they come -> audio chunks; closing ``tokens`` aborts the LM request."""
        keep = SilenceFilter(SILENT_TOKENS_V3).keep if self.family == "cosyvoice3" else (lambda _t: True)
        t_lm = time.perf_counter()
        try:
            async for tok in tokens:
                watch.add_tokens(1)
                if keep(tok):
                    utt.tokens.append(tok)
                if active.cancelled.is_set():
                    return
                async for pcm in self._drain(utt, False, active, watch):
                    yield pcm
        finally:
            await tokens.aclose()  # type: ignore[attr-defined]
            watch.add_stage("lm", time.perf_counter() - t_lm - sum(utt.stage_s.values()))
        async for pcm in self._drain(utt, True, active, watch):
            yield pcm

    async def _drain(
        self, utt: Utterance, lm_done: bool, active: _Active, watch: Stopwatch
    ) -> AsyncIterator[np.ndarray]:
        """Run every chunk the planner has ready, each due when the client's buffered audio runs out."""
        playback = active.playback
        while not active.cancelled.is_set() and (
            job := utt.planner.next_job(len(utt.tokens), lm_done, playback.buffered_s())
        ):
            if job.end == 0:
                return
            before = dict(utt.stage_s)
            watch.mark("first_chunk_ready")
            due = playback.deadline()  # None: the first audio, due as it is queued
            pcm = await self.token2wav.run(utt, job, due, active.first)  # a no-op on the ticket once ended
            if utt.last_times is not None:
                watch.chunk_computed(utt.last_times, job.end)
            if utt.first_job_started is not None:
                watch.mark("first_chunk_started", utt.first_job_started)
            for stage in ("flow", "hift"):
                watch.add_stage(stage, utt.stage_s[stage] - before[stage])
            yield pcm

    # ------------------------------------------------------------------ voices
    def add_voice(
        self,
        name: str,
        prompt_wav: str | tuple[np.ndarray, int],
        prompt_text: str,
        owner: str | None = None,
        consent: str = "",
    ) -> Voice:
        """Save a voice for ``owner`` (a browser id or API key; None: a public voice, the operator's);
        ``consent`` is the speaker's consent reference, stored with it."""
        if not prompt_text.strip():
            raise InvalidInput("a saved voice needs the transcript of its prompt audio", field="prompt_text")
        features = self.frontend.extract(prompt_wav, trim=True)
        return self.voices.add(name, features, prompt_text.strip(), self.family, prompt_wav, owner, consent)

    def list_voices(self, owner: str | None = None) -> list[Voice]:
        """The examples, the public voices and ``owner``'s own."""
        return self.voices.list(owner)

    def delete_voice(self, voice_id: str, owner: str | None = None) -> None:
        self.voices.delete(voice_id, owner)

    def voice_preview(self, voice_id: str, owner: str | None = None) -> Path | None:
        """The recording a voice was made from (an example's own wav, a saved voice's kept prompt), for a
        preview or to save it again; None when none was kept. NotFound as ``delete_voice``."""
        example = self.voices.examples.get(voice_id)
        return example.wav if example is not None else self.voices.preview_path(voice_id, owner)

    @property
    def asr_model(self) -> str | None:
        """The Whisper's name (loaded, or loading: a transcription waits for it), None when it is off."""
        return self.asr.name if self.asr is not None else None

    @property
    def word_timer(self) -> WordTimer | None:
        """What times a script's words for its subtitles (Whisper, waiting for its load), None when off."""
        return self.asr

    async def transcribe(self, audio: AudioInput, language: str | None = None) -> Transcript:
        """The prompt's text and language, computed in a worker thread (synthesis keeps running); the
        first ones after the start wait for Whisper's load."""
        if self.asr is None:
            raise InvalidInput("transcription is off on this server (--asr-model none): type the transcript")
        transcriber = await self.asr.ready()
        return await asyncio.to_thread(transcriber.transcribe, audio, language)

    def example_voices(self) -> list[ExampleVoice]:
        return list(self.voices.examples.values())


def _ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def _cuda_mps(cfg: EngineConfig) -> contextlib.AbstractContextManager[devices.CudaMps | None]:
    """The engine's MPS daemon (started on entry, told to quit on exit): with ``cfg.cuda_mps`` True, or in
    auto (None) where the LM runs on vLLM in its own process and MPS can start (``devices.auto_mps``)."""
    root = cache_root(cfg.cache_dir) / "mps"
    if cfg.cuda_mps is None:  # auto_mps goes on only for a CUDA device: ask as for an accelerator
        return devices.auto_mps(root, cfg.device, _uses_vllm(cfg, accelerator=True))
    return devices.CudaMps(root) if cfg.cuda_mps else contextlib.nullcontext()


def _prefix(lm: SpeechLM, text_ids: list[int], prompt_ids: list[int], speech_ids: list[int]) -> torch.Tensor:
    """The LM's prompt embeddings (device work: off the event loop)."""
    with torch.inference_mode():
        return lm.prefix_embeds(_ids(text_ids), _ids(prompt_ids), _ids(speech_ids))


def _beside_the_lm(
    cfg: EngineConfig,
    files: ModelDir,
    dev: torch.device,
    timeline: Timeline,
    text: TextFrontend,
    weights: Future[LoadedModel],
    builder: GraphBuilder,
    early: TextPool | None,
) -> tuple[LoadedModel, GraphedHiFT | None, _Parts]:
    """What loads while the LM backend starts: the weights (``weights``, loading since the start), the
    flow and vocoder graph wrappers (with ``graphs_early``, their first graphs), the frontends."""
    graphs = cfg.cuda_graphs and devices.graphs_supported(dev)
    cache = cache_root(cfg.cache_dir)
    if graphs and not _imports_vllm_here(cfg, dev):
        # Dynamo's import (~3 s on the H200) while the weights load rather than after: in-process vLLM's
        # import does it beside them anyway; with lm_host it came between the weights and the first graphs
        _flow_compile_cache(files.family, cfg, cache)
    model, vocoder = weights.result(), None
    if cfg.flow_attention == "folded":
        model.flow.decoder.fold_attention()
    if graphs:
        model.flow.decoder = _graphed_flow(model.flow.decoder, model.family, cfg, cache)  # type: ignore[assignment]
    if graphs and cfg.hift_graphs and isinstance(model.hift, CausalHiFTGenerator):
        vocoder = GraphedHiFT(model.hift)
    if _graphs_early(cfg, dev):
        # vLLM's engine core is still importing (~20 s from its spawn): these captures run before it
        # measures the device's free memory (with lm_kv_cache_gib it measures nothing); the reuse pool
        # leaves it the share it will take
        _first_graphs(model, vocoder, cfg, dev, builder, lm_share=_lm_share(cfg, dev))
    return model, vocoder, _frontends(cfg, files, model.family, dev, cache, timeline, text, early)


def _loading(
    cfg: EngineConfig, files: ModelDir, dev: torch.device, timeline: Timeline
) -> Future[LoadedModel]:
    """The weights loading on a thread of their own from now on, beside the tokenizer and the LM backend's
    start (vLLM's import alone is seconds): the load imports no transformers and its copies (file pages,
    host to device) run outside the interpreter. Safetensors after the first."""
    loader = ThreadPoolExecutor(1, thread_name_prefix="weights")
    try:
        cache, onto = cache_root(cfg.cache_dir), cfg.weights_onto_device
        return loader.submit(_timed, timeline, "weights", load_model, files, dev, cache, onto)
    finally:
        loader.shutdown(wait=False)  # the thread ends with its one job


def _builds_while_lm_starts(cfg: EngineConfig, dev: torch.device, handover: bool) -> bool:
    """Whether the graph builder begins once the first graphs are captured, not at ready: where ready
    waits for vLLM's start (no handover; ~20 s on an H100) the builder's jobs (the flow's programs, the
    other graphs: ~12 s on an H100 warm) fill that wait, so the first requests meet fewer of them. Where
    the first graphs come early by default, vLLM's KV cache is of a fixed size and these captures change
    nothing it measures; a forced ``first_graphs_early`` beside a profiling vLLM takes them into the race
    that option accepts."""
    return not handover and _graphs_early(cfg, dev)


def _graphs_early(cfg: EngineConfig, dev: torch.device) -> bool:
    """The first graphs beside the LM backend's start: only a vLLM start is long enough to hide them."""
    return cfg.graphs_early and _uses_vllm(cfg, devices.is_accelerator(dev))


def _lm_share(cfg: EngineConfig, dev: torch.device) -> float:
    """The fraction of the device vLLM will take once started: its gpu_memory_utilization, or a fixed KV
    cache plus what it holds beside (``LM_BESIDE_KV_GIB``)."""
    if not _uses_vllm(cfg, devices.is_accelerator(dev)):
        return 0.0
    if cfg.lm_kv_cache_gib is None:
        return cfg.gpu_memory_utilization
    total = devices.total_memory_bytes(dev)  # 0 where the driver says nothing (the CPU): no pool to size
    return min(1.0, (cfg.lm_kv_cache_gib + LM_BESIDE_KV_GIB) * 2**30 / total) if total else 0.0


def _backend(
    cfg: EngineConfig, files: ModelDir, dev: torch.device, weights: Callable[[], LoadedModel]
) -> LMBackend:
    """vLLM where it is installed and a GPU/NPU is present (or asked for), else the native loop. vLLM
    starts from llm.pt's export (read from the file, or from the cache when warm), not from the loaded
    model: ``weights`` (blocking until the load is done) is waited for only after its start."""
    if _uses_vllm(cfg, devices.is_accelerator(dev)):
        backend = _vllm(cfg, _hf_export(cfg, files))
        backend.lm = weights().lm  # text streaming embeds its rounds with the loaded LM
        return backend
    from engine.lm.native import NativeLM

    lm = weights().lm
    return NativeLM(lm, cfg.sampling, slot=_decode_slot(cfg, lm))


def _vllm(cfg: EngineConfig, export: Path) -> VLLMBackend | HostedLM:
    """vLLM on the LM's export: in this process, or with ``lm_host`` in a host process of its own."""
    settings: dict[str, Any] = {
        "profile_dir": cfg.lm_profile_dir, "ras_graphs": cfg.lm_ras_graphs,
        "kv_cache_gib": cfg.lm_kv_cache_gib,
    }  # fmt: skip
    if cfg.lm_host:
        from engine.lm.lm_host import HostedLM, HostSpec

        return HostedLM(HostSpec(export, cfg.sampling, cfg.gpu_memory_utilization, **settings))
    with transformers_import():  # vLLM imports it; Whisper's load may be importing it too
        from engine.lm.vllm_backend import VLLMBackend

    return VLLMBackend(export, cfg.sampling, cfg.gpu_memory_utilization, **settings)


def _handover(
    model: LoadedModel,
    cfg: EngineConfig,
    dev: torch.device,
    started: Future[LMBackend],
    timeline: Timeline,
    gate: StartGate | None,
) -> HandoverLM:
    """The native loop on the loaded LM, serving until vLLM (``started``, held by ``gate`` if any) is up;
    its device memory (KV caches) is emptied from torch's cache once it is retired."""
    from engine.lm.native import NativeLM

    native = NativeLM(model.lm, cfg.sampling, slot=_decode_slot(cfg, model.lm))
    return HandoverLM(native, started, timeline, lambda: devices.empty_cache(dev), gate)


def _started_lm(gate: StartGate | None, timeline: Timeline, *lm: object) -> LMBackend:
    """The LM backend's start (``_backend(*lm)``), a phase of ``timeline`` from when it begins: once
    ``gate`` opens, if any."""
    if gate is not None:
        gate.wait()  # GateCancelled where the load failed or the engine closed first
    return _timed(timeline, "LM backend", _backend, *lm)


def _decode_slot(cfg: EngineConfig, lm: SpeechLM) -> DecodeSlot | None:
    """The native loop's graphed step for a lone request, where asked for and graphs are supported."""
    if not (cfg.lm_native_graphs and devices.graphs_supported(lm.speech_embedding.weight.device)):
        return None
    return DecodeSlot(lm)


def _start_fork_server(cfg: EngineConfig, dev: torch.device) -> None:
    """Where vLLM serves and ``lm_fork_server`` asks for it: the process its engine core forks from,
    started now (engine.lm.fork_server): vLLM's imports there run beside this load from here on."""
    if cfg.lm_fork_server and _uses_vllm(cfg, devices.is_accelerator(dev)):
        fork_server.start()  # nothing where it started at launch (server.main: fork_server.start_first)


def _uses_vllm(cfg: EngineConfig, accelerator: bool) -> bool:
    """vLLM serves the LM: asked for, or in auto where it is installed and the device is a GPU/NPU."""
    return cfg.backend == "vllm" or (cfg.backend == "auto" and accelerator and devices.has_vllm())


def _hf_export(cfg: EngineConfig, files: ModelDir) -> Path:
    """The LM's export for vLLM: the cached one, else written from llm.pt (memory-mapped, on the CPU)."""
    from engine.checkpoint import read_model_config, read_state
    from engine.lm.hf_export import export_hf, finished_export

    cache = cache_root(cfg.cache_dir)
    done = finished_export(files.llm, cache)
    if done is not None:
        return done
    qwen = read_model_config(files.root)[2]
    return export_hf(read_state(files.llm), qwen, files.llm, cache)


def _graphed_flow(cfm: CausalCFM, family: str, cfg: EngineConfig, cache: Path) -> GraphedCFM:
    """The flow solver as CUDA graphs (same forward(inputs, streaming)), of the compiled estimator if on."""
    compiled, cudnn = cfg.compiles_flow(family), cfg.flow_attention == "cudnn"
    kept = _flow_compile_cache(family, cfg, cache)
    aot = AotRoot(cache / "compile" / "aot", cudnn) if cfg.flow_aot else None
    # used only where torch.compile compiles (CompiledEstimator._compiled): moot when eager or AOT-packaged
    precompiled = kept / "precompiled" if cfg.flow_precompiled else None
    dtype = getattr(torch, cfg.flow_dtype)
    stepped, child = cfg.flow_step_graphs, cfg.flow_compile_child
    return GraphedCFM(
        cfm, dtype, compiled=compiled, aot=aot, precompiled=precompiled, stepped=stepped, compile_child=child
    )


def _flow_compile_cache(family: str, cfg: EngineConfig, cache: Path) -> Path:
    """The flow's compile cache under ``cache``, set as Inductor's (importing Dynamo) where it compiles."""
    # cuDNN's order changes which attention op a traced graph calls, not the graph Dynamo sees, which
    # is what a cache entry may be found by: its programs get a cache of their own
    kept = cache / "compile" / "attention-cudnn" if cfg.flow_attention == "cudnn" else cache / "compile"
    if cfg.compiles_flow(family):
        use_compile_cache(kept)  # the second call (from _graphed_flow) finds it set: no more than a log line
    return kept


def _imports_vllm_here(cfg: EngineConfig, dev: torch.device) -> bool:
    """vLLM serves from this process (not the LM host): its import, on the LM's start thread, imports
    Dynamo too; a second thread importing it at once is what this process then avoids."""
    return _uses_vllm(cfg, devices.is_accelerator(dev)) and not cfg.lm_host


def _first_graphs(
    model: LoadedModel,
    hift: GraphedHiFT | None,
    cfg: EngineConfig,
    dev: torch.device,
    builder: GraphBuilder,
    lm_share: float,
) -> None:
    """The reuse pool, then the first graphs (the rest queued on ``builder``), as one phase."""
    _enable_reuse(model.flow.decoder, model.family, cfg, dev, lm_share)
    with builder.timeline.phase("first graphs"):
        _precapture(model.flow.decoder, hift, cfg, dev, builder)


def _enable_reuse(flow: object, family: str, cfg: EngineConfig, dev: torch.device, lm_share: float) -> None:
    """The CUDA-graph solver's page pool for frame reuse (v3 and v2), sized by ``flow_reuse_gb`` or from the
    memory vLLM left (``lm_share``: the fraction of the device vLLM is still to take, when it has not yet);
    before the captures, which record its address. Requests keep up to ``graph_warmup_s`` (at least 16 s)
    of finished frames: the window graphs' prefix."""
    if not (isinstance(flow, GraphedCFM) and cfg.reuses_flow(family, graphed=True)):
        return
    gb = cfg.flow_reuse_gb
    if gb is None:
        left = devices.free_memory_bytes(dev) - lm_share * devices.total_memory_bytes(dev)
        nbytes = AUTO_POOL_SHARE * max(0.0, left)
    else:
        nbytes = gb * 2**30
    frames = int(max(cfg.graph_warmup_s, 16.0) * MEL_FRAMES_PER_S)
    pages = flow.enable_reuse(nbytes, frames, dev)
    if pages:
        log.info("flow reuse: a pool of %d pages (%.1f GiB)", pages, nbytes / 2**30)


def _precapture(
    flow: object, hift: GraphedHiFT | None, cfg: EngineConfig, dev: torch.device, builder: GraphBuilder
) -> None:
    """The flow (and vocoder) graphs a request can meet (batch up to the token2wav batch, mel up to
    ``graph_warmup_s``): with ``background_graphs`` the first of each kind now and the rest queued on
    ``builder`` (requests meanwhile replay a wider graph of their kind, padded), else all now, while nothing
    runs. Either way no request waits for a capture."""
    if cfg.graph_warmup_s <= 0:
        return
    batch = min(cfg.limits.max_concurrency, cfg.flow_batch)
    frames = int(cfg.graph_warmup_s * MEL_FRAMES_PER_S)
    later = builder.add if cfg.background_graphs else None
    # the vocoder's first: its background graphs (seconds) then precede the flow's compile, whose tracing
    # slows every uncaptured (op by op) call beside it
    for name, graphed in (("vocoder", hift), ("flow", flow)):
        if isinstance(graphed, GraphedCFM | GraphedHiFT):
            graphed.graphs.single_stream_now = cfg.single_stream_graphs_at_load
            t0 = time.perf_counter()
            n = graphed.precapture(batch, frames, dev, later)
            now = len(graphed.graphs)
            log.info("captured %d of %d %s graphs in %.1f s", now, n, name, time.perf_counter() - t0)


@dataclass(frozen=True)
class _Parts:
    """What loads beside the LM backend's start: the prompt frontend, voices; the text pool."""

    frontend: Frontend
    text: TextFrontend
    voices: VoiceLibrary
    pool: TextPool


def _frontends(
    cfg: EngineConfig,
    files: ModelDir,
    family: str,
    dev: torch.device,
    cache: Path,
    timeline: Timeline,
    text: TextFrontend,
    early: TextPool | None,
) -> _Parts:
    with timeline.phase("frontends"):
        limits = AudioLimits.for_prompt(cfg.limits)
        frontend = Frontend.from_model_dir(files, dev, limits=limits, cache_size=cfg.prompt_cache_size)
        root = Path(cfg.voices_dir) if cfg.voices_dir else cache / "voices"
        voices = VoiceLibrary(root, family, load_examples(cfg.examples_dir))
    pool = early or TextPool(text, 0)
    pool.attach(text)
    return _Parts(frontend, text, voices, pool)


def _started_pool(cfg: EngineConfig, files: ModelDir, dev: torch.device) -> TextPool | None:
    """The text worker processes, started now without waiting for them (load waits for them after the
    LM backend's start: ``wait_started``); None where the text runs in this process (the CPU's default)."""
    workers = cfg.text_workers
    if workers is None:
        workers = 4 if devices.is_accelerator(dev) else 0
    if workers == 0:
        return None
    pool = TextPool(None, workers, files.qwen, family=files.family)
    pool.start()
    return pool


def _or_close(fn: Callable[[], object], *closers: Callable[[], object]) -> None:
    """``fn()``; if it fails, ``closers`` run first (the text workers, vLLM's engine core process)."""
    try:
        fn()
    except BaseException:
        for close in closers:
            close()
        raise


def _timed(timeline: Timeline, name: str, fn: Callable[..., T], *args: object) -> T:
    with timeline.phase(name):
        return fn(*args)


async def counted(ids: AsyncIterator[list[int]], watch: Stopwatch) -> AsyncIterator[list[int]]:
    """A streamed text's ids, each piece counted as it passes (the usage's input tokens, as for a whole
    text)."""
    async for piece in ids:
        watch.add_text_tokens(len(piece))
        yield piece
