"""The token2wav worker's queue: chunk jobs ordered by playback deadline, taken a batch at a time.

Every job says when its audio is needed (``deadline``, clock s: a first chunk's is its arrival, a later
chunk's the moment the audio already delivered to that client runs out), how long its flow call is
(``frames``, mel frames of prompt + tokens) and whether it is a request's last call (``finalize``: full
attention, so it never shares a call with streaming chunks). A batch is formed earliest deadline first:

- the head is the job with the earliest deadline (ties: the one queued first); it fixes ``finalize`` and
  the frame bucket (``frame_bucket`` multiples, as the flow's CUDA graphs pad them);
- every other job of that kind joins in deadline order while there is room (``max_batch`` rows) if it is
  urgent (slack ``deadline - now <= urgent_s``: it must not wait for a later batch) or fits in the frame
  bucket so far (it rides along). A job with slack that would make every row pay for a longer call waits
  instead: a first chunk is not padded to the length of chunks with seconds of audio buffered;
- a relaxed job (slack over ``relaxed_s``: its client has plenty of audio buffered) joins only while the
  batch stays within ``budget`` padded row-frames (rows x frame bucket; ``call_cost`` turns the worker's
  measured speed into it). Riding along is not free once calls are compute-bound, and a call cannot be
  preempted: a first chunk (or a stream about to run dry) queued while a long call of relaxed chunks runs
  waits for all of it. Kept short, that call ends soon and the relaxed jobs go in later calls, still in
  time; ``relaxed_s`` = inf lets them fill the batch (the scheduler before this rule). The price is
  more calls, each with its fixed cost (launches, the vocoder, the copy out): where that cost is a large
  share of a call, a worker near its capacity loses throughput (tests/engine/serving/worker_sim.py shows
  both sides). So the rule may hold only ``when`` it can help: the engine's auto applies it while a stream
  has little audio buffered (``EngineConfig.t2w_relaxed_cap``), which a synchronized wave past its first
  chunks never has.

A call cannot be preempted, but it has a seam: between its flow and its vocoder. When every row of a
call has over ``relaxed_s`` to spare, the worker asks there (``take_urgent``) for a batch whose head is
urgent (a first chunk queued meanwhile, a stream about to run dry) and runs it whole before that call's
vocoder: a first chunk then waits for the rest of a flow call, not for its vocoder too (EngineConfig.
t2w_yield_to_urgent; the rows set aside lose a call's time out of their seconds of slack).

The quiet-first hold (``Hold``, EngineConfig.t2w_quiet_first, off until measured on a GPU): the LM and
the worker share the GPU (CUDA MPS), and a 16-row flow call slows the LM's decode step 4-5x while it runs
(BENCHMARKS.md, bench.overlap), so a new request's first-chunk tokens decode slowly behind calls nobody
needs yet. While a request's first chunk is being decoded (``first_chunk`` until its ticket ends), a batch
whose rows all have over the hold's ``slack_s`` waits: until that first chunk is queued (its urgent batch
then goes first), its head's slack falls to ``slack_s``, or ``bound_s`` passes, whichever comes first.
An urgent batch is never held; the rows held lose at most ``bound_s`` out of their seconds of slack. The
price is the worker's idle time: near its capacity that is throughput lost (worker_sim's ``hold_s``).

The first-chunk lane (EngineConfig.t2w_first_lane, on by default for v3 on a GPU): a second worker takes
first chunks one at a time (``take_first``) while the lane is open, so a first chunk queued while the main
worker runs a call need not wait for it; whichever worker is free first takes it.

Nobody starves: a job queued at ``t`` has a deadline >= ``t`` unless its client already ran dry, so once
a job's deadline is the earliest in the queue only jobs queued before it can take the head, and the head
always runs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from engine.serving.call_cost import CallCost


class Deadlined(Protocol):
    @property
    def deadline(self) -> float: ...  # clock s when the client needs this job's audio

    @property
    def frames(self) -> int: ...  # mel frames of the flow call (50 Hz)

    @property
    def finalize(self) -> bool: ...

    @property
    def first(self) -> bool: ...  # a streaming request's first chunk (the first-chunk lane takes these)


J = TypeVar("J", bound=Deadlined)


def frame_bucket_of(frames: int, frame_bucket: int) -> int:
    """Frames rounded up to the graph bucket's multiple (at least one bucket)."""
    return frame_bucket * max(1, math.ceil(frames / frame_bucket))


def pick_batch(
    queued: Sequence[J],
    now: float,
    max_batch: int,
    frame_bucket: int,
    urgent_s: float,
    relaxed_s: float = math.inf,
    budget: float = math.inf,
) -> list[J]:
    """The next batch from ``queued`` (in arrival order): see the module docstring. Empty in, empty out.
    ``budget``: padded row-frames (rows x frame bucket) that relaxed jobs may fill; the head always runs."""
    order = sorted(range(len(queued)), key=lambda i: (queued[i].deadline, i))
    if not order:
        return []
    head = queued[order[0]]
    batch, top = [head], frame_bucket_of(head.frames, frame_bucket)
    for i in order[1:]:
        if len(batch) == max_batch:
            break
        job = queued[i]
        if job.finalize != head.finalize:
            continue
        slack, size = job.deadline - now, frame_bucket_of(job.frames, frame_bucket)
        if slack > urgent_s and size > top:
            continue  # it would make every row pay for a longer call and can wait
        if slack > relaxed_s and (len(batch) + 1) * max(top, size) > budget:
            continue  # the call would run long for audio nobody needs yet
        batch.append(job)
        top = max(top, size)
    return batch


@dataclass(frozen=True)
class Relaxed:
    """The rule for relaxed jobs: over ``slack_s`` of slack they fill a batch only up to a call of about
    ``call_s``, at the speed ``cost`` measured (its row-frames budget; unlimited until a call was timed)."""

    slack_s: float = 2.0
    call_s: float = 0.2
    cost: CallCost = field(default_factory=CallCost)

    def __post_init__(self) -> None:
        if self.slack_s < 0 or self.call_s <= 0:
            raise ValueError(f"need slack_s >= 0 and call_s > 0, got {self.slack_s} and {self.call_s}")

    def budget(self) -> float:
        return self.cost.row_frames_within(self.call_s)


@dataclass(frozen=True)
class Hold:
    """The quiet-first rule (module docstring): while a first chunk is being decoded a batch whose rows all
    have over ``slack_s`` (s) to spare waits, ``bound_s`` (s) at most."""

    slack_s: float = 2.0
    bound_s: float = 0.25

    def __post_init__(self) -> None:
        if self.slack_s < 0 or self.bound_s <= 0:
            raise ValueError(f"need slack_s >= 0 and bound_s > 0, got {self.slack_s} and {self.bound_s}")

    def wait_s(self, batch: Sequence[Deadlined], now: float, since: float) -> float:
        """How much longer (s) ``batch`` waits, held since ``since`` (clock s); <= 0: it runs now. Its
        least slack over ``slack_s`` is what it can give; an urgent or near row makes that <= 0."""
        spare = min(j.deadline for j in batch) - now - self.slack_s
        return min(spare, since + self.bound_s - now) if spare > 0 else 0.0


class FirstChunk:
    """A request's first chunk being decoded, counted by its queue from ``DeadlineQueue.first_chunk`` until
    ``end``: once, whoever comes first (the chunk's ``put``, the request's end however it ends)."""

    def __init__(self, end: Callable[[FirstChunk], None]):
        self._end = end
        self.open = True  # changed under the queue's lock

    def end(self) -> None:
        self._end(self)


class DeadlineQueue(Generic[J]):
    """Thread-safe: request threads ``put``, the worker ``take``s batches (blocking, no polling)."""

    def __init__(
        self,
        clock: Callable[[], float],
        max_batch: int,
        frame_bucket: int = 100,
        urgent_s: float = 0.3,
        relaxed: Relaxed | None = None,  # None: relaxed jobs fill batches like the others
        when: Callable[[], bool] | None = None,  # the relaxed rule holds while this says so (None: always)
        hold: Hold | None = None,  # the quiet-first hold (None: off)
    ):
        if max_batch < 1 or frame_bucket < 1 or urgent_s < 0:
            raise ValueError("need max_batch >= 1, frame_bucket >= 1 and urgent_s >= 0")
        if relaxed is not None and relaxed.slack_s < urgent_s:
            raise ValueError("need the relaxed slack_s >= urgent_s (an urgent job is never relaxed)")
        self.clock, self.max_batch = clock, max_batch
        self.frame_bucket, self.urgent_s, self.relaxed = frame_bucket, urgent_s, relaxed
        self.when, self._hold = when, hold
        self._jobs: list[J] = []
        self._closed = False
        self._changed = threading.Condition()
        self._decoding = 0  # first chunks being decoded (FirstChunk tickets not yet ended)
        self._lane_open = False  # a second worker takes first chunks (``take_first``) while open
        self.holding = threading.Event()  # set while ``take`` holds a batch back (what tests wait on)

    def __len__(self) -> int:
        with self._changed:
            return len(self._jobs)

    def snapshot(self) -> list[J]:
        """The queued jobs now (a copy)."""
        with self._changed:
            return list(self._jobs)

    @property
    def decoding(self) -> int:
        """First chunks being decoded now (tickets from ``first_chunk`` not yet ended)."""
        with self._changed:
            return self._decoding

    @property
    def hold(self) -> Hold | None:
        return self._hold

    @hold.setter
    def hold(self, hold: Hold | None) -> None:
        """Switch the hold (between batches; a take holding now looks again at once)."""
        with self._changed:
            self._hold = hold
            self._changed.notify_all()

    def first_chunk(self) -> FirstChunk:
        """A request's LM starts decoding its first chunk: counted until the ticket ends."""
        with self._changed:
            self._decoding += 1
        return FirstChunk(self._first_ended)

    def put(self, job: J, first: FirstChunk | None = None) -> None:
        """Queue ``job``; ``first``: its request's ticket, ended in the same step (the first chunk is queued),
        so a held take sees the job when it wakes."""
        with self._changed:
            if self._closed:
                raise RuntimeError("the token2wav queue is closed")
            self._jobs.append(job)
            if first is not None:
                self._end_first(first)
            self._changed.notify_all()

    def close(self) -> None:
        """``take`` hands out what is queued, then returns None."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def take(self) -> list[J] | None:
        """Block until a job is queued and no hold keeps its batch back; return the next batch and remove it.
        None once closed and empty. Woken by ``put``, an ended ticket, a switched hold or the hold's end."""
        with self._changed:
            since: float | None = None  # clock s when this take began holding a batch back
            while True:
                self._changed.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    self.holding.clear()
                    return None
                batch, now = self._pick(), self.clock()
                since = now if since is None else since
                wait_s = self._held_s(batch, now, since)
                if wait_s <= 0:
                    self.holding.clear()
                    return self._remove(batch)
                self.holding.set()
                self._changed.wait(wait_s)  # a clock that is not real time: looked at again after this

    def _held_s(self, batch: list[J], now: float, since: float) -> float:
        """How much longer the hold keeps ``batch`` back (s; <= 0: not at all), the lock held."""
        if self._hold is None or self._decoding == 0 or self._closed:
            return 0.0
        return self._hold.wait_s(batch, now, since)

    def _first_ended(self, first: FirstChunk) -> None:
        with self._changed:
            self._end_first(first)
            self._changed.notify_all()

    def _end_first(self, first: FirstChunk) -> None:
        """Uncount ``first`` once (the lock held)."""
        if first.open:
            first.open = False
            self._decoding -= 1

    @property
    def lane_open(self) -> bool:
        return self._lane_open

    @lane_open.setter
    def lane_open(self, on: bool) -> None:
        """Open (or close) the first-chunk lane: ``take_first`` hands out first chunks only while open."""
        with self._changed:
            self._lane_open = on
            self._changed.notify_all()

    def take_first(self) -> list[J] | None:
        """The first-chunk lane's take: block until a first chunk (``first``) is queued while the lane is
        open and take it alone, the earliest deadline first; None once closed (the main worker drains the
        rest). The main worker's ``take`` may take first chunks too: whichever worker is free first."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or self._first_at() is not None)
            at = None if self._closed else self._first_at()
            return None if at is None else [self._jobs.pop(at)]

    def _first_at(self) -> int | None:
        """The index of the queued first chunk with the earliest deadline, while the lane is open (the lock
        held); None when there is none."""
        if not self._lane_open:
            return None
        firsts = [(j.deadline, i) for i, j in enumerate(self._jobs) if j.first]
        return min(firsts)[1] if firsts else None

    def take_urgent(self) -> list[J] | None:
        """Without blocking: the next batch if its head is urgent (a first chunk, a stream about to run
        dry), removed; None when nothing queued is. The worker asks between a call's flow and its vocoder
        when every row of that call has time to spare."""
        with self._changed:
            if not self._jobs:
                return None
            batch = self._pick()
            return self._remove(batch) if batch[0].deadline - self.clock() <= self.urgent_s else None

    def _pick(self) -> list[J]:
        """The next batch (the lock held, the queue not empty)."""
        relaxed_s, budget = math.inf, math.inf
        if self.relaxed is not None and (self.when is None or self.when()):
            relaxed_s, budget = self.relaxed.slack_s, self.relaxed.budget()
        return pick_batch(
            self._jobs, self.clock(), self.max_batch, self.frame_bucket, self.urgent_s, relaxed_s, budget
        )

    def _remove(self, batch: list[J]) -> list[J]:
        taken = {id(j) for j in batch}
        self._jobs = [j for j in self._jobs if id(j) not in taken]
        return batch
