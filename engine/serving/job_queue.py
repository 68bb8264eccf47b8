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
    ):
        if max_batch < 1 or frame_bucket < 1 or urgent_s < 0:
            raise ValueError("need max_batch >= 1, frame_bucket >= 1 and urgent_s >= 0")
        if relaxed is not None and relaxed.slack_s < urgent_s:
            raise ValueError("need the relaxed slack_s >= urgent_s (an urgent job is never relaxed)")
        self.clock, self.max_batch = clock, max_batch
        self.frame_bucket, self.urgent_s, self.relaxed = frame_bucket, urgent_s, relaxed
        self.when = when
        self._jobs: list[J] = []
        self._closed = False
        self._changed = threading.Condition()

    def __len__(self) -> int:
        with self._changed:
            return len(self._jobs)

    def snapshot(self) -> list[J]:
        """The queued jobs now (a copy)."""
        with self._changed:
            return list(self._jobs)

    def put(self, job: J) -> None:
        with self._changed:
            if self._closed:
                raise RuntimeError("the token2wav queue is closed")
            self._jobs.append(job)
            self._changed.notify()

    def close(self) -> None:
        """``take`` hands out what is queued, then returns None."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def take(self) -> list[J] | None:
        """Block until a job is queued; return the next batch and remove it. None once closed and empty."""
        with self._changed:
            self._changed.wait_for(lambda: self._jobs or self._closed)
            if not self._jobs:
                return None
            return self._remove(self._pick())

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
