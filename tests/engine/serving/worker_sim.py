"""A fake-clock model of the token2wav worker under open-loop arrivals, for scheduling and admission tests.

Streams arrive as a seeded Poisson process; stream s's chunk k (25 tokens = 1 s of audio) has its tokens at
``arrival + 0.15 + 0.1 k`` s (an LM at 250 tokens/s) and is queued once they are there and chunk k - 1 is
back (the engine runs a stream's chunks in order). The worker takes ``pick_batch`` batches; a batch costs
``base_s + per_row_s x rows x buckets`` (every row pays for the batch's frame bucket: padding is not free).
A client plays from its first audio on; a later chunk back after its audio ran out is a miss (an underrun).
``fifo`` is the arrival-order A/B: each job is due when queued and every job is urgent (no buckets).
``relaxed``: the rule that keeps calls of chunks with slack short, learning the call cost from the batches
as the worker does (None: such chunks fill the batches, the scheduler before the rule); ``auto``: the rule
holds only while a stream that has arrived (as the engine counts its requests from submit, before their
first chunk) has less than its ``slack_s`` of audio buffered and more to come.
``streams`` arrive at ``rate`` per second; a huge rate is a synchronized wave.
``admit(now)`` decides each new stream at its first chunk (refused: it never runs).
``hold_s``: the engine's quiet-first hold (EngineConfig.t2w_quiet_first, off by default), its trade-off
(bench/results/2026-12-03-h200-capacity-relaxed-auto-4e04e18): while a stream that has arrived waits for its
first chunk and every queued chunk has over the relaxed ``slack_s`` to spare, the worker idles (up to
``hold_s``) rather than start a call the first chunk would wait behind. The model's LM runs at one speed
whatever the worker does, so it shows only the hold's cost, not what it is for on a GPU the LM shares
(a flow call there slows the LM's decode step 4-5x: the first tokens come sooner with the worker idle).
``seam``: the engine's yield (EngineConfig.t2w_yield_to_urgent): between the flow (``1 - VOCODER_SHARE`` of
a call) and the vocoder of a call whose rows all have over the relaxed ``slack_s``, a batch with an urgent
head queued meanwhile runs whole.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import StreamConfig
from engine.serving.job_queue import Relaxed, frame_bucket_of, pick_batch

PROMPT_TOKENS = 90
BUCKET = 100
URGENT_S = StreamConfig().urgent_slack_s  # s: a chunk this close to its deadline is urgent, as in the engine
# of a call's time, after its flow (the H200 trace's calls that first chunks waited on at 1/s: 78 of 129 ms)
VOCODER_SHARE = 0.6


@dataclass
class SimJob:
    stream: int
    k: int
    ready: float  # s: queued
    due: float  # s: the playback deadline (a first chunk: when queued)
    deadline: float  # s: what the scheduler is told
    frames: int
    finalize: bool


@dataclass
class Outcome:
    misses: int = 0  # later chunks back after their client's audio ran out
    first_s: list[float] = field(default_factory=list)  # queued -> back, first chunks
    refused: int = 0
    served: int = 0
    end_s: float = 0.0  # when the worker handed back the last chunk: the load's makespan

    @property
    def first_p95_s(self) -> float:
        xs = sorted(self.first_s)
        return xs[int(0.95 * (len(xs) - 1))]


class WorkerSim:
    def __init__(
        self, rate: float, streams: int = 40, chunks: int = 10, seed: int = 0, per_row_s: float = 0.004
    ):
        rng = random.Random(seed)
        self.arrivals, t = [], 0.0
        for _ in range(streams):
            self.arrivals.append(t)
            t += rng.expovariate(rate)
        self.lengths = [rng.randint(chunks // 2, chunks * 3 // 2) for _ in range(streams)]  # +-50 %
        self.per_row_s, self.base_s = per_row_s, 0.03
        self.now = 0.0
        self.runs_out: list[float | None] = [None] * streams
        self.sent = [0] * streams  # chunks back per stream
        self.queue: list[SimJob] = []
        self.live: set[int] = set()

    def pressure(self) -> float | None:
        """The engine's admission signal: the least slack (s) among the queued chunks whose client has audio
        buffered and the buffers of the streams playing past their first chunk."""
        queued = [j.due - self.now for j in self.queue if j.due > j.ready]
        playing = [
            out - self.now for s in self.live if (out := self.runs_out[s]) is not None and self.sent[s] > 1
        ]
        return min(queued + playing, default=None)

    def thin(self, slack_s: float, served: set[int]) -> bool:
        """Whether a stream that has arrived and is not yet served has under ``slack_s`` of audio buffered."""
        arrived = (s for s, t in enumerate(self.arrivals) if t <= self.now and s not in served)
        return any((self.runs_out[s] or self.now) - self.now < slack_s for s in arrived)

    def _holding(self, slack_s: float, served: set[int]) -> bool:
        """A stream that has arrived waits for its first chunk, and every queued chunk has over slack_s."""
        waiting = any(
            t <= self.now and s not in served and self.sent[s] == 0 and all(j.stream != s for j in self.queue)
            for s, t in enumerate(self.arrivals)
        )
        return waiting and min(j.deadline for j in self.queue) - self.now > slack_s

    def run(
        self,
        fifo: bool = False,
        admit: Callable[[], bool] = lambda: True,
        relaxed: Relaxed | None = None,
        auto: bool = False,
        hold_s: float = 0.0,
        seam: bool = False,
    ) -> Outcome:
        self.out, self.fifo, self.admit = Outcome(), fifo, admit
        self.pending = {s: self._job(s, fifo) for s in range(len(self.arrivals))}
        self.served: set[int] = set()
        held_since: float | None = None
        while self.pending or self.queue:
            self._arrive()
            if not self.queue:
                self.now = min(j.ready for j in self.pending.values())
                continue
            if relaxed and hold_s and self._holding(relaxed.slack_s, self.served):
                held_since = self.now if held_since is None else held_since
                if self.now < held_since + hold_s:  # idle until a chunk is ready, the hold ends or one is due
                    least = min(j.deadline for j in self.queue) - relaxed.slack_s
                    ready = [j.ready for j in self.pending.values() if j.ready > self.now]
                    self.now = min([*ready, held_since + hold_s, max(least, self.now)])
                    continue
            held_since = None
            self._call(self._pick(relaxed, auto), relaxed, auto, seam)
        self.out.end_s = self.now
        return self.out

    def _arrive(self) -> None:
        """Queue every chunk whose tokens are ready (a new stream's first: if admitted)."""
        for s, job in sorted(self.pending.items()):
            if job.ready > self.now:
                continue
            del self.pending[s]
            if job.k == 0 and not self.admit():
                self.out.refused += 1
                self.served.add(s)  # never runs: nobody waits for its audio
                continue
            self.live.add(s)
            self.queue.append(job)

    def _pick(self, relaxed: Relaxed | None, auto: bool) -> list[SimJob]:
        slack_s, budget = math.inf, math.inf
        if relaxed and (not auto or self.thin(relaxed.slack_s, self.served)):
            slack_s, budget = relaxed.slack_s, relaxed.budget()
        urgent_s = math.inf if self.fifo else URGENT_S
        return pick_batch(self.queue, self.now, 16, BUCKET, urgent_s, slack_s, budget)

    def _call(self, batch: list[SimJob], relaxed: Relaxed | None, auto: bool, seam: bool) -> None:
        """One call: its flow, then (``seam``, every row with over the relaxed slack) an urgent batch queued
        meanwhile run whole, then its vocoder; its rows come back at its end."""
        for job in batch:
            self.queue.remove(job)
        top = frame_bucket_of(max(j.frames for j in batch), BUCKET)
        call_s = self.base_s + self.per_row_s * len(batch) * top / BUCKET
        if seam and relaxed and all(j.due - self.now > relaxed.slack_s for j in batch):
            self.now += call_s * (1 - VOCODER_SHARE)
            self._arrive()
            urgent = self._pick(relaxed, auto) if self.queue else []
            if urgent and urgent[0].deadline - self.now <= URGENT_S:
                self._call(urgent, relaxed, auto, seam=False)
            self.now += call_s * VOCODER_SHARE
        else:
            self.now += call_s
        if relaxed:
            relaxed.cost.observe(len(batch), top, call_s)
        for job in batch:
            self._back(job, self.out)
            if job.k + 1 < self.lengths[job.stream]:
                self.pending[job.stream] = self._job(job.stream, self.fifo)
            else:
                self.live.discard(job.stream)
                self.served.add(job.stream)
                self.out.served += 1

    def _back(self, job: SimJob, out: Outcome) -> None:
        if job.k == 0:
            out.first_s.append(self.now - job.ready)
        elif self.now > job.due + 1e-9:
            out.misses += 1
        last = self.runs_out[job.stream]
        self.runs_out[job.stream] = (self.now if last is None else max(last, self.now)) + 1.0
        self.sent[job.stream] += 1

    def _job(self, s: int, fifo: bool) -> SimJob:
        k = self.sent[s]
        ready = max(self.arrivals[s] + 0.15 + 0.1 * k, self.now if k else 0.0)
        out = self.runs_out[s]
        due = ready if out is None else out
        frames = 2 * (PROMPT_TOKENS + 25 * (k + 1))
        return SimJob(s, k, ready, due, ready if fifo else due, frames, k == self.lengths[s] - 1)
