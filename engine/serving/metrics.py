"""Per-request timing (queue wait, time to first audio, RTF, LM tokens/s, stage ms) and server gauges."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STAGES = ("frontend", "lm", "flow", "hift")
# Where the time to first audio goes, in order (their sum is the TTFA): waiting for a slot, text and prompt
# work, the LM until the first chunk's tokens are there, that chunk waiting for the token2wav worker, and
# its flow + HiFT.
TTFA_PARTS = ("queue", "frontend", "lm", "t2w_wait", "t2w_compute")
_TTFA_MARKS = ("started", "frontend_done", "first_chunk_ready", "first_chunk_started", "first_audio")


@dataclass(frozen=True)
class RequestMetrics:
    """An immutable snapshot; times in milliseconds, audio in seconds, ``rtf`` = compute s / audio s."""

    request_id: str = ""
    seed: int = 0
    queue_wait_ms: float = 0.0
    ttfa_ms: float | None = None
    elapsed_ms: float = 0.0
    audio_s: float = 0.0
    lm_tokens: int = 0
    lm_tokens_per_s: float = 0.0
    text_tokens: int = 0  # text tokens the speech LM read (the input of OpenAI's usage)
    stage_ms: dict[str, float] = field(default_factory=dict)
    ttfa_parts_ms: dict[str, float] = field(default_factory=dict)  # TTFA_PARTS, once there is audio
    done: bool = False

    @property
    def rtf(self) -> float | None:
        return None if self.audio_s <= 0 else (self.elapsed_ms / 1000.0) / self.audio_s


@dataclass(eq=False)
class ChunkTimes:
    """One chunk's way through the token2wav worker, stamped by the worker (its clock, s): queued when its
    tokens were ready, taken in a batch of ``batch`` rows padded to ``bucket_frames`` mel frames (its own
    call: ``frames``), flow done, vocoder done (its audio handed back)."""

    ready: float
    due: float  # when its client needs the audio (the playback deadline, whatever order the worker keeps)
    joined: float | None = None
    batch: int = 0
    bucket_frames: int = 0
    frames: int = 0
    flow_done: float | None = None
    vocoded: float | None = None
    lane: str = "main"  # the token2wav worker that ran it: "main", or "first" (the first-chunk lane)
    # mel frames its request's flow cache held as it was queued (its flow call computes from there): a
    # first chunk's are a kept voice's prompt frames (EngineConfig.flow_voice_pages), else 0
    cached_frames: int = 0


@dataclass(frozen=True)
class ChunkTrace:
    """One sent chunk's timeline, ms after the request was submitted: ``bench --trace`` writes these.

    ``deadline_ms`` is when the client needed it (a first chunk: when it was queued; a later one: when the
    audio sent before runs out), ``slack_ms = deadline_ms - sent_ms`` (below 0: the listener waited, an
    underrun for a later chunk). ``lm_first_token_ms``: the request's first speech token from the LM, after
    ``frontend_ms`` (its prompt's features and text ready), ``flow_prompt_ms`` (the flow's prompt tensors made
    on the device) and ``prefix_ms`` (the LM's prompt embeddings made, as its first LM request was handed to
    the backend): the first token's wait in parts."""

    index: int
    tokens: int  # speech tokens up to this chunk's end
    ready_ms: float
    joined_ms: float | None
    batch: int
    bucket_frames: int
    frames: int
    flow_done_ms: float | None
    vocoded_ms: float | None
    sent_ms: float
    deadline_ms: float
    slack_ms: float
    audio_s: float
    lm_first_token_ms: float | None
    lane: str = "main"  # the token2wav worker that ran it (ChunkTimes.lane)
    cached_frames: int = 0  # ChunkTimes.cached_frames
    # the engine's load as its request started (what the fast start's rule read): requests computing, and
    # those that started within StreamConfig.fast_start_burst_s (None: not counted), this one included
    computing_at_start: int | None = None
    recent_starts: int | None = None
    frontend_ms: float | None = None
    prefix_ms: float | None = None
    flow_prompt_ms: float | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    def row(self) -> dict[str, Any]:
        """JSON-ready, with ``first``."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__} | {"first": self.first}


class Stopwatch:
    """Mutable per-request timer owned by one request's generator; ``snapshot()`` freezes it.

    ``clock`` returns seconds (monotonic); tests inject a fake one.
    """

    def __init__(self, request_id: str, seed: int, clock: Callable[[], float] = time.perf_counter):
        self.request_id, self.seed, self._clock = request_id, seed, clock
        self.t_submit = clock()
        self.t_start: float | None = None
        self.t_first_audio: float | None = None
        self.t_lm_start: float | None = None
        self.t_prefix: float | None = None  # the first LM request's prompt embeddings made (prefix_made)
        self.t_flow_prompt: float | None = None  # the first segment's flow prompt made (flow_prompt_made)
        self.t_first_text: float | None = None  # text-streaming requests: TTFA counts from here
        self.lm_tokens = 0
        self.text_tokens = 0
        self.audio_s = 0.0
        self.stage_ms = dict.fromkeys(STAGES, 0.0)
        self.marks: dict[str, float] = {}  # first time each TTFA milestone was reached (clock s)
        self.chunks_sent = 0
        # the last computed chunk not yet sent: its worker times and token count
        self._computed: tuple[ChunkTimes, int] | None = None
        self.load: tuple[int, int | None] = (0, None)  # (computing, recent starts) as the audio began

    def load_at_start(self, computing: int, recent: int | None) -> None:
        """The engine's load as this request's audio began (its trace's ``computing_at_start``, ...)."""
        self.load = (computing, recent)

    def now(self) -> float:
        return self._clock()

    def started(self) -> None:
        """The request left the queue and began computing."""
        self.t_start = self._clock()
        self.mark("started", self.t_start)

    def first_text(self) -> None:
        """The first piece of a streamed text arrived (called for every piece; the first one counts)."""
        if self.t_first_text is None:
            self.t_first_text = self._clock()

    def mark(self, milestone: str, at: float | None = None) -> None:
        """Record the first time ``milestone`` (one of the TTFA milestones) happened: now, or ``at``
        (a time on this stopwatch's clock taken elsewhere, e.g. by the token2wav worker)."""
        if milestone not in _TTFA_MARKS:
            raise ValueError(f"unknown milestone {milestone!r}; expected one of {_TTFA_MARKS}")
        if milestone not in self.marks:
            self.marks[milestone] = self._clock() if at is None else at

    def ttfa_parts_ms(self) -> dict[str, float]:
        """The TTFA split at its milestones (ms); empty until every milestone has happened."""
        if not all(m in self.marks for m in _TTFA_MARKS):
            return {}
        times = [self.t_submit, *(self.marks[m] for m in _TTFA_MARKS)]
        return {part: (b - a) * 1000.0 for part, a, b in zip(TTFA_PARTS, times, times[1:])}

    def add_stage(self, stage: str, seconds: float) -> None:
        self.stage_ms[stage] = self.stage_ms.get(stage, 0.0) + seconds * 1000.0

    def flow_prompt_made(self) -> None:
        """The flow's prompt tensors are on the device (the first segment's ``Utterance`` counts)."""
        if self.t_flow_prompt is None:
            self.t_flow_prompt = self._clock()

    def prefix_made(self) -> None:
        """The LM's prompt embeddings are made and its request goes to the backend (the first one counts)."""
        if self.t_prefix is None:
            self.t_prefix = self._clock()

    def add_tokens(self, n: int) -> None:
        if self.t_lm_start is None:
            self.t_lm_start = self._clock()
        self.lm_tokens += n

    def add_text_tokens(self, n: int) -> None:
        self.text_tokens += n

    def add_audio(self, seconds: float) -> None:
        if self.t_first_audio is None and seconds > 0:
            self.t_first_audio = self._clock()
            self.mark("first_audio", self.t_first_audio)
        self.audio_s += seconds

    def chunk_computed(self, times: ChunkTimes, tokens: int) -> None:
        """The worker handed back a chunk's audio (``times``, its ``due`` the client's deadline)."""
        self._computed = (times, tokens)

    def chunk_sent(self, seconds: float) -> ChunkTrace | None:
        """The chunk computed last leaves for the client now: its trace (None when none was computed)."""
        if self._computed is None:
            return None
        (times, tokens), self._computed = self._computed, None
        deadline = times.due
        now, index = self._clock(), self.chunks_sent
        self.chunks_sent += 1

        def ms(t: float | None) -> float | None:
            return None if t is None else (t - self.t_submit) * 1000.0

        return ChunkTrace(
            index=index,
            tokens=tokens,
            ready_ms=(times.ready - self.t_submit) * 1000.0,
            joined_ms=ms(times.joined),
            batch=times.batch,
            bucket_frames=times.bucket_frames,
            frames=times.frames,
            flow_done_ms=ms(times.flow_done),
            vocoded_ms=ms(times.vocoded),
            sent_ms=(now - self.t_submit) * 1000.0,
            deadline_ms=(deadline - self.t_submit) * 1000.0,
            slack_ms=(deadline - now) * 1000.0,
            audio_s=seconds,
            lm_first_token_ms=ms(self.t_lm_start),
            lane=times.lane,
            cached_frames=times.cached_frames,
            computing_at_start=self.load[0],
            recent_starts=self.load[1],
            frontend_ms=ms(self.marks.get("frontend_done")),
            prefix_ms=ms(self.t_prefix),
            flow_prompt_ms=ms(self.t_flow_prompt),
        )

    def snapshot(self, done: bool = False) -> RequestMetrics:
        now = self._clock()
        start = self.t_start if self.t_start is not None else now
        lm_s = now - self.t_lm_start if self.t_lm_start is not None else 0.0
        origin = self.t_submit if self.t_first_text is None else max(self.t_submit, self.t_first_text)
        return RequestMetrics(
            request_id=self.request_id,
            seed=self.seed,
            queue_wait_ms=(start - self.t_submit) * 1000.0,
            ttfa_ms=None if self.t_first_audio is None else (self.t_first_audio - origin) * 1000.0,
            elapsed_ms=(now - start) * 1000.0,
            audio_s=self.audio_s,
            lm_tokens=self.lm_tokens,
            text_tokens=self.text_tokens,
            lm_tokens_per_s=self.lm_tokens / lm_s if lm_s > 0 else 0.0,
            stage_ms=dict(self.stage_ms),
            ttfa_parts_ms=self.ttfa_parts_ms(),
            done=done,
        )


@dataclass(frozen=True)
class ServerStats:
    """Server-wide gauges for the UI's server panel and ``/metrics``."""

    active_streams: int = 0
    queued: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0  # aborted, stopped or disconnected by the caller
    audio_s_total: float = 0.0
    lm_tokens_total: int = 0
    device_memory_mb: float = 0.0
    device: str = "cpu"
