"""Per-request timing (queue wait, time to first audio, RTF, LM tokens/s, stage ms) and server gauges."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
        self.t_first_text: float | None = None  # text-streaming requests: TTFA counts from here
        self.lm_tokens = 0
        self.text_tokens = 0
        self.audio_s = 0.0
        self.stage_ms = dict.fromkeys(STAGES, 0.0)
        self.marks: dict[str, float] = {}  # first time each TTFA milestone was reached (clock s)

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
