"""Speech tokens -> waveform: flow matching then HiFT, run by one worker thread per device.

Every request keeps its own ``Utterance`` (prompt conditioning, chunk planner, vocoder continuation); the
worker takes chunk jobs from all active requests, a batch at a time earliest playback deadline first
(``job_queue``; a call made of chunks with plenty of slack kept short, at the speed the worker measures,
so a first chunk does not wait long behind it), so GPU work is serialised by one owner we time instead of
interleaving threads. The one exception, on by default for v3 on a GPU: the first-chunk lane
(``open_first_lane``, engine.serving.first_lane), a second worker that takes streaming requests' first
chunks with graphs and a device stream of its own, beside the main worker's call.
``run`` is awaited by the request's coroutine. HiFT runs a batch's rows together where that gives each row
what it gets alone (``Token2Wav._groups``): v3's non-final chunks in one right-padded call, its final chunks
in two (``CausalHiFTGenerator.finals``), v2's in groups of one input shape (by default on a GPU/NPU only),
each row's noise drawn from its own request's generator.

With ``flow_reuse`` each streaming ``Utterance`` owns a flow cache, made by the flow solver: the eager one
gives v3 a ``DiTCache`` and v2 a ``UNetCache``, the CUDA-graph one (with a page pool) a ``PagedCache``.
Its non-final flow calls compute only the frames after the chunks finished in earlier calls (exact; see
engine.flow.dit_cache, engine.flow.unet_cache and engine.flow.dit_pages). The final call recomputes
everything with full attention and frees the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function  # labels for bench.profile; near free when off

from engine import device as devices
from engine.config import EAGER_REUSE_GB, EngineConfig, StreamConfig
from engine.errors import SynthesisFailed
from engine.flow.cfm import Flow, FlowBatch
from engine.flow.dit_cache import DiTCache, ReuseBudget
from engine.flow.dit_pages import PagedCache
from engine.flow.graphs import GraphedCFM
from engine.flow.precompiled import serving_thread
from engine.flow.voice_pages import VoicePages, voice_frames, voice_key
from engine.frontend import PromptFeatures
from engine.serving.job_queue import DeadlineQueue, FirstChunk, Hold, Relaxed, frame_bucket_of
from engine.serving.kept_prompts import KeptPrompts, PromptTensors
from engine.serving.metrics import ChunkTimes
from engine.serving.streaming import TOKEN_MEL_RATIO, ChunkJob, ChunkPlanner
from engine.vocoder.hift import TAIL_FRAMES, CausalHiFTGenerator, HiFTGenerator, V2Noise
from engine.vocoder.streaming import Hift3, V2VocoderState, V3VocoderState

log = logging.getLogger(__name__)
FIRST_LANE = "first"  # ChunkTimes.lane of the chunks the first-chunk lane ran


def never() -> bool:
    """``thin`` with nobody to ask (a worker without an engine): no stream is known to be short of audio."""
    return False


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
    first_job_started: float | None = None  # perf_counter s when the worker began this segment's first chunk
    last_times: ChunkTimes | None = None  # the worker's stamps of the chunk computed last (its trace)
    # streaming with flow reuse: finished flow frames (v2: a UNetCache; the CUDA-graph solver: a PagedCache)
    flow_cache: DiTCache | PagedCache | None = None
    # EngineConfig.flow_voice_pages: the voice's key (engine.flow.voice_pages) while its prompt may be kept
    voice: bytes | None = None


@dataclass(eq=False)
class _Job:
    utt: Utterance
    chunk: ChunkJob
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[np.ndarray]
    deadline: float  # clock s when the client needs this audio
    # the worker's stamps for the trace (the scheduler's jobs: queued now, due at the playback deadline)
    times: ChunkTimes = field(default_factory=lambda: ChunkTimes(math.nan, math.nan))
    first: bool = False  # a streaming request's first chunk: the first-chunk lane may take it

    @property
    def frames(self) -> int:
        """Mel frames of this job's flow call: prompt and tokens so far, 2 frames a token."""
        return TOKEN_MEL_RATIO * (self.utt.prompt_tokens.shape[1] + self.chunk.end)

    @property
    def finalize(self) -> bool:
        return self.chunk.finalize


@dataclass(frozen=True)
class Lane:
    """What one token2wav worker thread runs: the flow (its decoder: that worker's own CUDA graphs, whose
    input buffers cannot serve two threads at once) and v3's graphed vocoder (None: the module's own)."""

    flow: Flow
    hift_graphs: Hift3 | None


@dataclass(frozen=True)
class Batching:
    """How the worker's batches form (``engine.serving.job_queue``): rows per call, the flow graphs' frame
    bucket (mel frames), the slack (s) under which a job always joins, ``fifo``: arrival order, no
    buckets (the scheduler's A/B: every job is due when queued and counts as urgent), and ``relaxed``:
    over ``relaxed_s`` of slack a job joins only while the call stays within about ``relaxed_call_s``
    (False: it fills the batch like the others, the scheduler before that rule; None: auto, only while
    the scheduler's ``thin`` says a stream has little audio buffered); ``yield_to_urgent``: a call whose
    rows all have over ``relaxed_s`` of slack lets an urgent batch run between its flow and its vocoder;
    ``quiet_first``: while a first chunk is being decoded, a call whose rows all have over ``relaxed_s``
    waits for it, ``quiet_hold_s`` at most (``job_queue.Hold``)."""

    max_batch: int = EngineConfig.flow_batch
    frame_bucket: int = 100
    urgent_s: float = 0.3
    fifo: bool = False
    relaxed: bool | None = True
    relaxed_s: float = 2.0
    relaxed_call_s: float = 0.2
    yield_to_urgent: bool = True  # an urgent batch may run between the flow and vocoder of a relaxed call
    quiet_first: bool = False  # relaxed calls wait while a first chunk is being decoded
    quiet_hold_s: float = 0.25  # s: the longest such a wait (a call of ~16 rows takes about that long)


class ChunkScheduler:
    """Deadline batching for the token2wav worker: request coroutines ``submit`` chunk jobs, the worker thread
    takes ``next_batch`` (earliest playback deadline first) and reports each batch's time (``ran``: the
    relaxed rule's speed), and admission reads ``least_slack_s``. ``thin``: whether a stream now has little
    audio buffered (the engine's view of its clients), which the relaxed rule's auto waits for."""

    def __init__(self, batching: Batching, clock: Callable[[], float], thin: Callable[[], bool] = never):
        self.clock, self.fifo, self.thin = clock, batching.fifo, thin
        # the seam between a call's flow and its vocoder is open to urgent batches (never in arrival order)
        self.yield_to_urgent = batching.yield_to_urgent and not batching.fifo
        urgent_s = math.inf if batching.fifo else batching.urgent_s
        # the rule learns the worker's speed whether or not it caps calls (``relaxed_cap`` switches it)
        self.relaxed: Relaxed | None = None
        if not batching.fifo:
            self.relaxed = Relaxed(batching.relaxed_s, batching.relaxed_call_s)
        self._queue: DeadlineQueue[_Job] = DeadlineQueue(
            clock, batching.max_batch, batching.frame_bucket, urgent_s
        )
        if self.relaxed is not None:
            self.relaxed_cap = batching.relaxed
        # the quiet-first hold, switchable like the relaxed rule (arrival order has no slack to hold on)
        self.hold = None if batching.fifo else Hold(batching.relaxed_s, batching.quiet_hold_s)
        if self.hold is not None:
            self.quiet_first = batching.quiet_first
        self.pending = 0  # jobs submitted and not yet taken

    def job(
        self, utt: Utterance, chunk: ChunkJob, loop: asyncio.AbstractEventLoop, deadline: float | None
    ) -> _Job:
        """A chunk job due at ``deadline`` (clock s; None: now, as a first chunk); its times keep the playback
        deadline whatever order the queue is told to keep."""
        now = self.clock()
        due = now if deadline is None or self.fifo else deadline
        # a request's chunks run one after another, so its cache is as this chunk's call will find it
        cached = 0 if utt.flow_cache is None else utt.flow_cache.frames
        return _Job(
            utt,
            chunk,
            loop,
            loop.create_future(),
            due,
            ChunkTimes(now, due if deadline is None else deadline, cached_frames=cached),
            first=deadline is None and not chunk.finalize,
        )

    def submit(self, job: _Job, first: FirstChunk | None = None) -> None:
        """Queue ``job``; ``first``: its request's first-chunk ticket, ended as it is queued (a no-op once
        ended)."""
        self.pending += 1
        self._queue.put(job, first)

    def first_chunk(self) -> FirstChunk:
        """A request's LM starts on its first chunk: relaxed calls may wait for it until the ticket ends."""
        return self._queue.first_chunk()

    @property
    def decoding(self) -> int:
        """First chunks being decoded now (tickets not yet ended)."""
        return self._queue.decoding

    @property
    def holding(self) -> threading.Event:
        """Set while the worker holds a relaxed call back for a first chunk being decoded."""
        return self._queue.holding

    @property
    def quiet_first(self) -> bool:
        """Whether relaxed calls wait while a first chunk is being decoded (``Batching.quiet_first``)."""
        return self._queue.hold is not None

    @quiet_first.setter
    def quiet_first(self, on: bool) -> None:
        """Switch the hold between batches: the open-loop bench's A/B of both arms in one load."""
        if self.hold is None:
            raise ValueError("arrival order (fifo) has no slack to hold relaxed calls on")
        self._queue.hold = self.hold if on else None

    def next_batch(self) -> list[_Job] | None:
        """Block until a batch is due and take it: its rows whose requests are still there (maybe none),
        stamped for the trace. None once closed and drained."""
        jobs = self._queue.take()
        return None if jobs is None else self._taken(jobs)

    def next_first(self) -> list[_Job] | None:
        """The first-chunk lane's next batch: block until a first chunk is queued while the lane is open,
        and take it alone, stamped for the trace (empty when its request went away). None once closed."""
        jobs = self._queue.take_first()
        if jobs is None:
            return None
        for job in jobs:
            job.times.lane = FIRST_LANE
        return self._taken(jobs)

    @property
    def first_lane(self) -> bool:
        """Whether the first-chunk lane takes first chunks now (Token2Wav.open_first_lane)."""
        return self._queue.lane_open

    @first_lane.setter
    def first_lane(self, on: bool) -> None:
        """Switch the lane between batches: the open-loop bench's A/B of both arms in one load."""
        self._queue.lane_open = on

    def urgent_batch(self, running: list[_Job]) -> list[_Job] | None:
        """Between the flow and the vocoder of ``running`` (a batch from ``next_batch``): the next batch if
        its head is urgent and every row of ``running`` has over the relaxed rule's slack, taken and
        stamped like ``next_batch``'s (maybe empty, when its requests went away); else None."""
        if not self.yield_to_urgent or self.relaxed is None or not running:
            return None
        now = self.clock()
        if any(j.times.due - now <= self.relaxed.slack_s for j in running):
            return None
        jobs = self._queue.take_urgent()
        return None if jobs is None else self._taken(jobs)

    def _taken(self, jobs: list[_Job]) -> list[_Job]:
        """A batch out of the queue: its rows whose requests are still there, stamped for the trace."""
        self.pending -= len(jobs)
        live = [j for j in jobs if not j.future.cancelled()]
        if live:
            now, bucket = self.clock(), frame_bucket_of(max(j.frames for j in live), self._queue.frame_bucket)
            for job in live:
                job.times.joined, job.times.batch = now, len(live)
                job.times.bucket_frames, job.times.frames = bucket, job.frames
        return live

    def ran(self, jobs: list[_Job], seconds: float) -> None:
        """The worker ran ``jobs`` (a batch from ``next_batch``) in ``seconds``: the relaxed rule's speed."""
        if self.relaxed is not None and jobs:
            bucket = frame_bucket_of(max(j.frames for j in jobs), self._queue.frame_bucket)
            self.relaxed.cost.observe(len(jobs), bucket, seconds)

    def least_slack_s(self) -> float | None:
        """The least playback slack (s) among the queued chunks whose client still had audio buffered when
        they were queued (None: no such chunk): how close the admitted streams are to running dry."""
        now = self.clock()
        slacks = [j.times.due - now for j in self._queue.snapshot() if j.times.due > j.times.ready]
        return min(slacks, default=None)

    @property
    def relaxed_cap(self) -> bool | None:
        """Whether calls of relaxed chunks are kept short (``Batching.relaxed``) now: always (True), never
        (False) or while ``thin`` (None, auto): read off the queue's rule and its gate."""
        if self._queue.relaxed is None:
            return False
        return None if self._queue.when is not None else True

    @relaxed_cap.setter
    def relaxed_cap(self, mode: bool | None) -> None:
        """Switch the rule between batches: the open-loop bench's A/B of both arms in one load."""
        if self.relaxed is None:
            raise ValueError("arrival order (fifo) has no relaxed rule to switch")
        self._queue.relaxed = None if mode is False else self.relaxed
        self._queue.when = self.thin if mode is None else None

    @property
    def max_batch(self) -> int:
        return self._queue.max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        self._queue.max_batch = value

    def close(self) -> None:
        self._queue.close()


class Token2Wav:
    """The worker: one thread takes the scheduler's batches and runs flow then HiFT on them, retrying a
    failed batch's requests one by one so only the request at fault fails."""

    def __init__(
        self,
        flow: Flow,
        hift: HiFTGenerator | CausalHiFTGenerator,
        family: str,
        device: torch.device,
        stream_cfg: StreamConfig,
        max_batch: int = EngineConfig.flow_batch,  # chunks per flow (and HiFT) call
        own_stream: bool = False,
        hift_graphs: Hift3 | None = None,  # v3: GraphedHiFT, called like CausalHiFTGenerator.inference
        frame_bucket: int = 100,  # mel frames; the flow graphs' bucket, so batches keep to one graph
        clock: Callable[[], float] = time.perf_counter,  # deadlines' clock (s); tests inject a fake one
        fifo: bool = False,  # arrival order, no frame buckets: the scheduler's A/B
        relaxed_cap: bool | None = False,  # calls of chunks with slack kept short (Batching.relaxed)
        thin: Callable[[], bool] = never,  # a stream has little audio buffered: auto's (None's) signal
        yield_to_urgent: bool = True,  # urgent batches may run between a relaxed call's flow and vocoder
        quiet_first: bool = False,  # relaxed calls wait while a first chunk is being decoded
        flow_reuse: bool = True,  # reuse finished frames where the solver can (flow_cache)
        voice_pages: bool = False,  # a voice's prompt pages kept across its requests (a page pool's)
        kept_prompts: int = 0,  # voices whose prompt tensors stay on the device (KeptPrompts; 0: none)
        reuse_gb: float | None = None,  # the eager solver's frame caches together; None: EAGER_REUSE_GB
        # v2's HiFT rows of one shape in one call; None: on a GPU/NPU (a call there is launch-bound), not
        # on the CPU (a batched call of full-size rows took 1.3-2.4x the time of the rows one by one)
        v2_hift_groups: bool | None = None,
    ):
        self.hift, self.family, self.device = hift, family, device
        # the main worker's flow and graphed vocoder; the first-chunk lane's thread sees its own (``_lane``)
        self._main, self._lane = Lane(flow, hift_graphs), threading.local()
        self._first: threading.Thread | None = None  # the first-chunk lane's worker (open_first_lane)
        # the lane's calls on a high-priority device stream (EngineConfig.t2w_lane_priority), read per batch
        self.lane_urgent = False
        # the main worker's device streams (its own, the default), made as it starts (None, None off CUDA);
        # ``own_stream`` picks one per batch (EngineConfig.t2w_own_stream; the bench's A/B switches it)
        self._main_streams: tuple[object | None, object | None] = (None, None)
        self.flow_reuse, self.reuse_budget = (
            flow_reuse,
            ReuseBudget((EAGER_REUSE_GB if reuse_gb is None else reuse_gb) * 2**30),
        )
        # EngineConfig.flow_voice_pages, read per request (the bench's A/B switches it); the lane's windows
        # after a voice's prefix are captured only where it is on at the load
        self.voice_pages = voice_pages
        if voice_pages and isinstance(flow.decoder, GraphedCFM):
            flow.decoder.voice_windows = True
        self.v2_groups = devices.is_accelerator(device) if v2_hift_groups is None else v2_hift_groups
        self.prompts = KeptPrompts(
            device, kept_prompts
        )  # EngineConfig.t2w_kept_prompts; the bench resizes it
        self.stream_cfg, self.own_stream, self.clock, self.fifo = stream_cfg, own_stream, clock, fifo
        batching = Batching(
            max_batch,
            frame_bucket,
            stream_cfg.urgent_slack_s,
            fifo,
            relaxed_cap,
            stream_cfg.relaxed_slack_s,
            stream_cfg.relaxed_call_s,
            yield_to_urgent,
            quiet_first,
        )
        self.scheduler = ChunkScheduler(batching, clock, thin)
        self._thread = threading.Thread(target=self._loop, name="token2wav", daemon=True)
        self._thread.start()

    def utterance(
        self,
        features: PromptFeatures,
        seed: int,
        stream: bool,
        speed: float = 1.0,
        schedule: StreamConfig | None = None,
        flow_reuse: bool | None = None,
        tensors: PromptTensors | None = None,
    ) -> Utterance:
        """Fresh per-segment state; ``features`` carries the (trimmed) prompt tokens/mel/embedding.
        ``schedule``: another chunk schedule for this one (the reference-style baseline's); ``flow_reuse``:
        False recomputes the flow's prefix in every call even where the worker reuses it (None: the
        worker's setting); ``tensors``: ``features`` already on the device (else kept or copied now)."""
        dev, schedule = self.device, schedule or self.stream_cfg
        # the fast start's trim (StreamConfig.fast_start_trim): only a 2:1-aligned prompt loses its head
        cut = schedule.flow_prompt_cut(len(features.speech_tokens)) if stream and features.trimmed else 0
        # the prompt's tensors (kept per voice, or copied now), viewed past the cut; never written
        prompt = tensors if tensors is not None else self.prompts.get(features)
        tokens, emb = prompt.tokens[:, cut:], prompt.embedding
        feat = prompt.feat[:, TOKEN_MEL_RATIO * cut :]
        planner = ChunkPlanner(tokens.shape[1], schedule, stream, feat.shape[1])
        v2 = self.family == "cosyvoice2"
        reuse = self.reuses_flow and stream and flow_reuse is not False
        cache = self.flow.decoder.frame_cache(self.reuse_budget) if reuse else None
        voice = self._voice(features, cut, cache)
        if v2:
            gen = torch.Generator(device=dev).manual_seed(seed)
            state = V2VocoderState(self.stream_cfg)
            return Utterance(tokens, feat, emb, planner, state, gen, speed, flow_cache=cache, voice=voice)
        state3 = V3VocoderState()
        return Utterance(tokens, feat, emb, planner, state3, None, speed, flow_cache=cache, voice=voice)

    def _voices(self) -> VoicePages | None:
        decoder = self.flow.decoder
        return decoder.voices if self.voice_pages and isinstance(decoder, GraphedCFM) else None

    def _voice(self, features: PromptFeatures, cut: int, cache: DiTCache | PagedCache | None) -> bytes | None:
        """EngineConfig.flow_voice_pages: the voice's key (the prompt as the flow reads it, ``cut`` tokens
        trimmed), the fresh page cache begun with the voice's kept prompt pages where it is kept."""
        if not isinstance(cache, PagedCache) or (voices := self._voices()) is None:
            return None
        mel = features.prompt_mel[TOKEN_MEL_RATIO * cut :]
        key = voice_key(np.asarray(features.speech_tokens[cut:]), mel, np.asarray(features.speaker_embedding))
        return None if voices.start(key, cache) else key  # a kept voice's request has nothing to donate

    def _keep_voices(self, utts: list[Utterance]) -> None:
        """After a committed streaming call: each row's voice keeps its prompt pages, if not kept yet (a row
        that donated them stops asking)."""
        if (voices := self._voices()) is None:
            return
        lookahead, ratio = self.flow.pre_lookahead_len, self.flow.token_mel_ratio
        for u in utts:
            if u.voice is not None and isinstance(u.flow_cache, PagedCache):
                frames = voice_frames(u.prompt_tokens.shape[1], lookahead, voices.pool.layout.chunk, ratio)
                if voices.keep(u.voice, u.flow_cache, frames):
                    u.voice = None

    async def run(
        self, utt: Utterance, chunk: ChunkJob, deadline: float | None = None, first: FirstChunk | None = None
    ) -> np.ndarray:
        """Compute one chunk's new audio: float32 [samples] at 24 kHz. ``deadline``: when the client
        needs it (``clock`` s; default now, as for a first chunk); ``first``: the request's first-chunk
        ticket (``first_chunk``), ended as this chunk is queued."""
        job = self.scheduler.job(utt, chunk, asyncio.get_running_loop(), deadline)
        self.scheduler.submit(job, first)
        pcm = await job.future
        utt.last_times = job.times
        return pcm

    def least_slack_s(self) -> float | None:
        return self.scheduler.least_slack_s()

    @property
    def flow(self) -> Flow:
        """The flow of the calling thread's worker: the first-chunk lane's on its thread, else the main one
        (whose decoder also makes the requests' frame caches: the lane's shares its page pool)."""
        return getattr(self._lane, "parts", self._main).flow

    @property
    def hift_graphs(self) -> Hift3 | None:
        """v3's graphed vocoder of the calling thread's worker (as ``flow``)."""
        return getattr(self._lane, "parts", self._main).hift_graphs

    def open_first_lane(self, flow: Flow, hift_graphs: Hift3 | None) -> None:
        """Start the first-chunk lane: a second worker thread, on a device stream of its own, that takes
        streaming requests' first chunks one at a time (whichever worker is free first takes one), with its
        own graphs (``flow``'s decoder, ``hift_graphs``; the module where there are none). A first chunk
        then need not wait behind a call of rows with seconds of audio to spare. ``first_lane`` switches
        it off and on again."""
        if self._first is not None:
            raise RuntimeError("the first-chunk lane is already open")
        lane = Lane(flow, hift_graphs)
        self._first = threading.Thread(target=self._serve_first, args=(lane,), name="token2wav-first")
        self._first.daemon = True
        self._first.start()
        self.scheduler.first_lane = True

    @property
    def first_lane(self) -> bool:
        """Whether the first-chunk lane is open and taking first chunks now."""
        return self._first is not None and self.scheduler.first_lane

    @first_lane.setter
    def first_lane(self, on: bool) -> None:
        if on and self._first is None:
            raise RuntimeError("no first-chunk lane: open_first_lane first")
        self.scheduler.first_lane = on

    def first_chunk(self) -> FirstChunk:
        """A request's LM starts on its first chunk: a ticket to end (``run``'s ``first``, or ``end``)."""
        return self.scheduler.first_chunk()

    @property
    def pending(self) -> int:
        return self.scheduler.pending

    @property
    def max_batch(self) -> int:
        """Chunks per flow (and HiFT) call; the scheduler forms the batches."""
        return self.scheduler.max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        self.scheduler.max_batch = value

    @property
    def reuses_flow(self) -> bool:
        """Streaming flow calls reuse finished frames: asked for, and the solver can (the eager one with the
        DiT or the U-Net; the CUDA-graph one with a page pool)."""
        return self.flow_reuse and bool(getattr(self.flow.decoder, "reuses_frames", False))

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and (self._first is None or self._first.is_alive())

    def close(self) -> None:
        self.scheduler.close()
        self._thread.join(timeout=10)
        if self._first is not None:
            self._first.join(timeout=10)

    def _loop(self) -> None:
        with serving_thread():  # a flow call no compiled program fits runs eager, not compiling here
            # the first-chunk lane hands its requests over to these (devices.used_on)
            self._main_streams = (devices.worker_stream(self.device), devices.current_stream(self.device))
            self._serve()

    def _serve(self) -> None:
        """One batch at a time, re-ordered after each: a chunk queued meanwhile with an earlier deadline
        runs next instead of after everything that was already waiting."""
        while (live := self.scheduler.next_batch()) is not None:
            with main_stream(self._main_streams, self.own_stream):
                if live:  # empty when its requests went away
                    t0 = time.perf_counter()
                    others_s = self._run_batch(live)
                    self.scheduler.ran(live, time.perf_counter() - t0 - others_s)
            # the worker waits for the next batch: this one must not keep its requests' state (a stream's
            # flow cache, gigabytes at full size) alive meanwhile
            del live

    def _serve_first(self, lane: Lane) -> None:
        """The first-chunk lane's thread: its own graphs (``lane``) and stream. It waits for neither the
        default stream nor the main worker's own, either of which may be running a call (waiting would
        queue it behind that call): what it reads was made by blocking copies (the prompt's tensors), on
        its own stream (tokens, page tables) or by calls of the same request that ended before this chunk
        was queued (their audio was copied to the host), and no call of another request writes the pages
        it reads. What it leaves in a request's state (the vocoder's history) is marked as used on both of
        the main worker's streams, either of which replaces and frees it later. The flow keeps no tensor
        per request here: the lane needs the graphed solver on a GPU (its page pool, or none;
        ``first_lane``). Its calls are not the relaxed rule's measure of the worker's speed (``ran``)."""
        self._lane.parts = lane
        # (normal, urgent): lane_urgent picks per batch; each batch is ordered after the other's work, so the
        # lane's calls stay in order (its graphs' input buffers are reused) whichever it ran on last
        streams = (devices.worker_stream(self.device), devices.worker_stream(self.device, urgent=True))
        with serving_thread():
            while (live := self.scheduler.next_first()) is not None:
                urgent = self.lane_urgent
                with devices.on_stream(streams[urgent], after=streams[not urgent]):
                    if live:  # empty when its request went away
                        self._run_batch(live)
                        for job in live:  # the requests' later chunks run on the main worker's streams
                            for tensor in job.utt.vocoder.tensors():
                                for main in self._main_streams:
                                    devices.used_on(tensor, main)
                del live

    def _deliver(self, job: _Job, value: np.ndarray | None, err: BaseException | None) -> None:
        job.times.vocoded = self.clock()
        _deliver(job, value, err)

    def _run_batch(self, jobs: list[_Job]) -> float:
        """Flow, then vocoder, for ``jobs``; between the two an urgent batch may run whole (``_let_in``).
        Returns the seconds spent on such batches, which are not this call's time."""
        started = time.perf_counter()
        for job in jobs:
            if job.utt.first_job_started is None:
                job.utt.first_job_started = started
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                with record_function("t2w.flow"):
                    mels = self._flow([j.utt for j in jobs], [j.chunk for j in jobs])
                share = (time.perf_counter() - t0) / len(jobs)
        except Exception as err:  # the worker keeps serving; only the request at fault fails
            if len(jobs) > 1:  # find it: run the batch's requests one by one
                log.warning("flow batch of %d failed (%s); retrying its requests one by one", len(jobs), err)
                return sum(self._run_batch([job]) for job in jobs)
            log.exception("flow failed")
            self._deliver(jobs[0], None, self._failure(err))
            return 0.0
        flow_done = self.clock()
        for job in jobs:
            job.utt.stage_s["flow"] += share
            job.times.flow_done = flow_done
        mels, others_s = self._let_in(jobs, mels)
        self._vocode_rows(jobs, mels)
        return others_s

    def _let_in(self, jobs: list[_Job], mels: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """At the seam between ``jobs``' flow and vocoder: run an urgent batch whole first if the scheduler
        has one for this call (its rows all have seconds to spare). The mels are copied first: the urgent
        flow call may replay the CUDA graph whose output buffers they view. -> (mels, seconds it took)."""
        urgent = self.scheduler.urgent_batch(jobs)
        if urgent is None:
            return mels, 0.0
        with torch.inference_mode():
            mels = [m.clone() for m in mels]
        t0 = time.perf_counter()
        if urgent:  # empty when its requests went away
            others_s = self._run_batch(urgent)
            self.scheduler.ran(urgent, time.perf_counter() - t0 - others_s)
        return mels, time.perf_counter() - t0

    def _vocode_rows(self, jobs: list[_Job], mels: list[torch.Tensor]) -> None:
        """HiFT for a flow batch's rows: each group that may share a call (``_groups``) runs as one; the
        other rows, and every row of a group whose call failed (to find the request at fault), one by one."""
        alone = list(range(len(jobs)))
        for group in self._groups(jobs, mels):
            try:
                with record_function("t2w.hift.batch"):
                    self._vocode_together([jobs[i] for i in group], [mels[i] for i in group])
                alone = [i for i in alone if i not in group]
            except Exception as err:  # the rows' states are as they were: one by one below
                log.warning(
                    "vocoder batch of %d failed (%s); retrying its requests one by one", len(group), err
                )
        for i in alone:
            try:
                with torch.inference_mode():
                    pcm = self._vocoder_step(jobs[i].utt, mels[i], jobs[i].chunk.finalize)
                self._deliver(jobs[i], pcm, None)
            except Exception as err:
                log.exception("vocoder step failed")
                self._deliver(jobs[i], None, self._failure(err))

    def _groups(self, jobs: list[_Job], mels: list[torch.Tensor]) -> list[list[int]]:
        """The rows (indices into ``jobs``) that may share one HiFT call, in groups of two or more.

        v3, non-final chunks: all rows, right-padded; the causal HiFT's zero padding cannot change a row's
        emitted prefix (the same property that lets each chunk re-vocode all mel so far). v3, final chunks:
        the rows of at least ``TAIL_FRAMES`` frames not stretched for speed (``CausalHiFTGenerator.finals``
        recomputes each row's right edge exactly). v2's HiFT is not
        causal (padding would change a row), so only rows of one input shape share a call: the same frames
        (cached + new, after a speed stretch), the same cached source samples and the same ``finalize``;
        each row's noise is drawn from its request's own generator, so a row gets the samples it gets alone.
        """
        if len(jobs) < 2:
            return []
        if isinstance(self.hift, CausalHiFTGenerator):
            rows = _v3_final_rows(jobs, mels) if jobs[0].chunk.finalize else list(range(len(jobs)))
            return [rows] if len(rows) > 1 else []
        if not self.v2_groups:
            return []
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for i, (job, mel) in enumerate(zip(jobs, mels)):
            if job.utt.generator is None:  # the global RNG's draws cannot be set aside for a retry
                continue
            call = _v2_state(job.utt).prepared(mel, job.finalize, job.utt.speed)
            groups.setdefault((call.mel.shape[2], call.source.shape[2], call.finalize), []).append(i)
        return [rows for rows in groups.values() if len(rows) > 1]

    def _vocode_together(self, jobs: list[_Job], mels: list[torch.Tensor]) -> None:
        """One HiFT call for all rows; a row whose audio is not finite fails alone. States change only
        after every row's audio is on the host, so a failure leaves them as they were for the retry."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            if isinstance(self.hift, HiFTGenerator):
                pcms = self._v2_together(self.hift, jobs, mels)
            elif jobs[0].chunk.finalize:
                pcms = self._v3_finals(jobs, mels)
            else:
                pcms = self._v3_together(jobs, mels)
        share = (time.perf_counter() - t0) / len(jobs)
        for job, pcm in zip(jobs, pcms):
            job.utt.stage_s["hift"] += share
            if np.isfinite(pcm).all():
                self._deliver(job, pcm, None)
            else:
                self._deliver(
                    job,
                    None,
                    SynthesisFailed("the vocoder produced non-finite audio; this request was stopped"),
                )

    def _v2_together(
        self, hift: HiFTGenerator, jobs: list[_Job], mels: list[torch.Tensor]
    ) -> list[np.ndarray]:
        """Rows of one input shape (``_groups``) -> each row's new audio; the states (and generators) advance
        only once all of it is on the host."""
        states = [_v2_state(j.utt) for j in jobs]
        calls = [st.prepared(m, j.finalize, j.utt.speed) for st, j, m in zip(states, jobs, mels)]
        # each row draws from a copy of its request's generator, as it would alone from the generator itself;
        # the generators take the copies' states with the vocoder states below
        gens = [_generator(j.utt) for j in jobs]
        forks = [_forked(g) for g in gens]
        noise = V2Noise.stack([hift.draw_noise(c.mel, f) for c, f in zip(calls, forks)])
        mel, source = torch.cat([c.mel for c in calls]), torch.cat([c.source for c in calls])
        speech, new_source = hift.vocode(mel, source, noise)
        faded = [st.faded(speech[i : i + 1]) for i, st in enumerate(states)]  # [1, T*480] each
        hosts = [f[0].float().cpu().numpy() for f in faded]
        for i, (st, call, gen, fork) in enumerate(zip(states, calls, gens, forks)):
            played = st.commit(call, faded[i], new_source[i : i + 1])  # a prefix of faded[i]
            hosts[i] = hosts[i][: played.shape[1]]
            gen.set_state(fork.get_state())
        return hosts

    def _v3_together(self, jobs: list[_Job], mels: list[torch.Tensor]) -> list[np.ndarray]:
        """Non-final rows, right-padded to the longest -> each row's new audio; the states advance only once
        all of it is on the host."""
        cfg = self.hift.config
        states = [_v3_state(j.utt) for j in jobs]
        fulls = [st.extended(m) for st, m in zip(states, mels)]
        width = max(f.shape[2] for f in fulls)
        speech = self._vocode_batch([j.utt for j in jobs], torch.cat([_right_pad(f, width) for f in fulls]))
        # row i's real audio: (T_i - withheld) frames x 480 samples; the rest came from padding
        ends = [(f.shape[2] - cfg.withheld_frames) * cfg.samples_per_frame for f in fulls]
        return _v3_emitted(states, fulls, [speech[i : i + 1, :end] for i, end in enumerate(ends)])

    def _v3_finals(self, jobs: list[_Job], mels: list[torch.Tensor]) -> list[np.ndarray]:
        """Final rows (``_v3_final_rows``) -> each row's last audio; the states advance only once all of it
        is on the host."""
        states = [_v3_state(j.utt) for j in jobs]
        fulls = [st.extended(m) for st, m in zip(states, mels)]
        return _v3_emitted(states, fulls, self._causal_hift().finals(fulls))

    def _vocode_batch(self, utts: list[Utterance], mel: torch.Tensor) -> torch.Tensor:
        """Non-final causal HiFT over right-padded rows (``utts``: their owners, row by row):
        mel [B, 80, T] -> speech [B, (T - withheld) * 480]."""
        return self._v3_vocoder()(mel, False)[0]

    def _v3_vocoder(self) -> Hift3:
        """v3's HiFT call: the graphed one when the engine built it, else the module's own."""
        return self.hift_graphs or self._causal_hift().inference

    def _causal_hift(self) -> CausalHiFTGenerator:
        if not isinstance(self.hift, CausalHiFTGenerator):
            raise TypeError("this needs the causal (v3) HiFT")
        return self.hift

    def _failure(self, err: Exception) -> Exception:
        """Out-of-memory becomes a clear SynthesisFailed (and the device cache is emptied)."""
        if not devices.is_out_of_memory(err):
            return err
        devices.empty_cache(self.device)
        return SynthesisFailed(
            "the device ran out of memory for this request; try a shorter text or again later"
        )

    def _vocoder_step(self, utt: Utterance, mel: torch.Tensor, finalize: bool) -> np.ndarray:
        t0 = time.perf_counter()
        with record_function("t2w.hift"):
            pcm = self._vocode(utt, mel, finalize)[0].float().cpu().numpy()
        utt.stage_s["hift"] += time.perf_counter() - t0
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
            return voc.step(mel, finalize, self._v3_vocoder(), utt.speed)
        raise TypeError(f"vocoder state {type(voc).__name__} does not fit {type(hift).__name__}")

    def _flow(self, utts: list[Utterance], chunks: list[ChunkJob]) -> list[torch.Tensor]:
        """One padded flow call for several requests' chunks (same ``finalize``) -> each one's new mel
        [1, 80, frames]. Right padding is exact: masks hide it from attention and the convs are causal."""
        dev = self.device
        tokens = [torch.tensor(u.tokens[: c.end], dtype=torch.long) for u, c in zip(utts, chunks)]
        token_len = torch.tensor([t.numel() for t in tokens], device=dev)
        prompt_len = torch.tensor([u.prompt_tokens.shape[1] for u in utts], device=dev)
        feat_len = torch.tensor([u.prompt_feat.shape[1] for u in utts], device=dev)
        finalize = chunks[0].finalize
        caches = None if finalize else _caches(utts, chunks)
        batch = FlowBatch(
            token=_stack([t[None] for t in tokens]).to(dev),
            token_len=token_len,
            prompt_token=_stack([u.prompt_tokens for u in utts]),
            prompt_token_len=prompt_len,
            prompt_feat=_stack([u.prompt_feat for u in utts]),
            prompt_feat_len=feat_len,
            embedding=torch.cat([u.embedding for u in utts]),
        )
        mel = self.flow.inference(batch, streaming=not finalize, finalize=finalize, caches=caches).float()
        if finalize:  # the last call: nothing reuses these frames any more
            _release(utts)
        elif caches is not None:
            self._keep_voices(utts)
        frames = self.flow.mel_lengths(token_len, prompt_len, feat_len, finalize).tolist()
        return [mel[i : i + 1, :, c.mel_start : n] for i, (c, n) in enumerate(zip(chunks, frames))]


def main_stream(streams: tuple[Any, Any], own: bool) -> contextlib.AbstractContextManager[Any]:
    """The main worker's stream for one batch, of ``streams`` (its own, the default; None, None off CUDA):
    its own (``own``), ordered after the default stream's work so far (tensors request threads just made),
    else the default, ordered after its own (the last batches there, when the setting changed). On its own
    stream a call no longer holds up the request threads' device work on the default one: a new request's
    prompt embeddings and copies, which otherwise wait for the call running to end (tens of ms under load,
    the LM's first token with them: ``python -m bench.trace``)."""
    mine, default = streams
    if mine is None:
        return contextlib.nullcontext()
    return devices.on_stream(mine, after=default) if own else devices.on_stream(default, after=mine)


def _caches(utts: list[Utterance], chunks: list[ChunkJob]) -> list[DiTCache | PagedCache] | None:
    """Every row's flow cache for a non-final batch, or None (recompute) when a row has none; the others
    then keep their caches as they were (still exact: their next window starts earlier). A cached call
    returns zeros before each row's cache boundary, so no chunk may emit a frame there."""
    caches = [u.flow_cache for u in utts]
    if any(c is None for c in caches):
        return None
    kept = [c for c in caches if c is not None]
    for u, chunk, cache in zip(utts, chunks, kept):
        first = u.prompt_feat.shape[1] + chunk.mel_start  # the first frame this chunk emits
        if first < cache.frames:
            raise RuntimeError(
                f"flow reuse: a chunk emits frame {first}, inside its {cache.frames} cached frames"
            )
    return kept


def _release(utts: list[Utterance]) -> None:
    for u in utts:
        if u.flow_cache is not None:
            u.flow_cache.clear()


def _v2_state(utt: Utterance) -> V2VocoderState:
    if not isinstance(utt.vocoder, V2VocoderState):
        raise TypeError(f"expected a v2 vocoder state, got {type(utt.vocoder).__name__}")
    return utt.vocoder


def _generator(utt: Utterance) -> torch.Generator:
    if utt.generator is None:
        raise ValueError("a v2 row vocoded with others needs its request's own generator")
    return utt.generator


def _forked(generator: torch.Generator) -> torch.Generator:
    """A new generator in ``generator``'s state, on its device."""
    fork = torch.Generator(device=generator.device)
    fork.set_state(generator.get_state())
    return fork


def _v3_final_rows(jobs: list[_Job], mels: list[torch.Tensor]) -> list[int]:
    """The final rows that may share ``CausalHiFTGenerator.finals``: at least ``TAIL_FRAMES`` frames of mel
    in all, and vocoding the mel as it is (a whole-file call at another speed stretches it first)."""
    rows = []
    for i, (job, mel) in enumerate(zip(jobs, mels)):
        state = _v3_state(job.utt)
        if not state.stretches(True, job.utt.speed) and state.frames + mel.shape[2] >= TAIL_FRAMES:
            rows.append(i)
    return rows


def _v3_emitted(
    states: list[V3VocoderState], fulls: list[torch.Tensor], rows: list[torch.Tensor]
) -> list[np.ndarray]:
    """Each row's speech [1, S] over its mel so far ``fulls`` -> the audio it has not sent yet; the states
    advance only after all of it is on the host (a failure before leaves them as they were)."""
    pcms = [row[0, st.emitted :].float().cpu().numpy() for st, row in zip(states, rows)]
    for st, full, row in zip(states, fulls, rows):
        st.commit(full, row)
    return pcms


def _v3_state(utt: Utterance) -> V3VocoderState:
    if not isinstance(utt.vocoder, V3VocoderState):
        raise TypeError(f"expected a v3 vocoder state, got {type(utt.vocoder).__name__}")
    return utt.vocoder


def _right_pad(mel: torch.Tensor, frames: int) -> torch.Tensor:
    """[1, 80, T] -> [1, 80, frames] with zero frames after T."""
    return torch.nn.functional.pad(mel, (0, frames - mel.shape[2]))


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad [1, L_i, ...] rows along dim 1 and stack them: [B, max L, ...]."""
    width = max(r.shape[1] for r in rows)
    out = rows[0].new_zeros((len(rows), width, *rows[0].shape[2:]))
    for i, r in enumerate(rows):
        out[i, : r.shape[1]] = r[0]
    return out


def _deliver(job: _Job, value: np.ndarray | None, err: BaseException | None) -> None:
    """Hand a result to the request's event loop; a loop that is gone means the request is gone too."""
    try:
        job.loop.call_soon_threadsafe(_resolve, job.future, value, err)
    except RuntimeError:  # its event loop was closed
        log.warning("dropped a result: its request's event loop is closed")


def _resolve(future: asyncio.Future[np.ndarray], value: np.ndarray | None, err: BaseException | None) -> None:
    if future.done():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(value)  # type: ignore[arg-type]
