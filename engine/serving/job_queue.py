"""The token2wav worker's queue: chunk jobs ordered by playback deadline, taken a batch at a time.

Every job says when its audio is needed (``deadline``, clock s: a first chunk's is its arrival, a later
chunk's the moment the audio already delivered to that client runs out), how long its flow call is
(``frames``, mel frames of prompt + tokens) and whether it is a request's last call (``finalize``: full
attention, so it never shares a call with streaming chunks). A batch is formed earliest deadline first:

- the head is the job with the earliest deadline (ties: the one queued first); it fixes ``finalize`` and
  the frame bucket (``frame_bucket`` multiples, as the flow's CUDA graphs pad them);
- every other job of that kind joins in deadline order while there is room (``max_batch`` rows) if it is
  urgent (slack ``deadline - now <= urgent_s``: it must not wait for a later batch) or fits in the frame
  bucket so far (it rides along for free). A job with slack that would make every row pay for a longer
  call waits instead: a first chunk is not padded to the length of chunks with seconds of audio buffered.

Nobody starves: a job queued at ``t`` has a deadline >= ``t`` unless its client already ran dry, so once
a job's deadline is the earliest in the queue only jobs queued before it can take the head, and the head
always runs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


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
    queued: Sequence[J], now: float, max_batch: int, frame_bucket: int, urgent_s: float
) -> list[J]:
    """The next batch from ``queued`` (in arrival order): see the module docstring. Empty in, empty out."""
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
        size = frame_bucket_of(job.frames, frame_bucket)
        if job.deadline - now <= urgent_s or size <= top:
            batch.append(job)
            top = max(top, size)
    return batch


class DeadlineQueue(Generic[J]):
    """Thread-safe: request threads ``put``, the worker ``take``s batches (blocking, no polling)."""

    def __init__(
        self, clock: Callable[[], float], max_batch: int, frame_bucket: int = 100, urgent_s: float = 0.3
    ):
        if max_batch < 1 or frame_bucket < 1 or urgent_s < 0:
            raise ValueError("need max_batch >= 1, frame_bucket >= 1 and urgent_s >= 0")
        self.clock, self.max_batch = clock, max_batch
        self.frame_bucket, self.urgent_s = frame_bucket, urgent_s
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
            batch = pick_batch(self._jobs, self.clock(), self.max_batch, self.frame_bucket, self.urgent_s)
            taken = {id(j) for j in batch}
            self._jobs = [j for j in self._jobs if id(j) not in taken]
            return batch
