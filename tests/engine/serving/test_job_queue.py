"""The token2wav queue's batch order (earliest deadline first, frame buckets, urgency) and starvation
freedom, on a fake clock: no sleeps, no threads except where ``take`` blocks."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from engine.serving.job_queue import DeadlineQueue, frame_bucket_of, pick_batch
from tests.conftest import WAIT_S
from tests.engine.serving.worker_sim import WorkerSim


@dataclass(frozen=True)
class Job:
    name: str
    deadline: float
    frames: int = 150
    finalize: bool = False


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def names(jobs: list[Job]) -> list[str]:
    return [j.name for j in jobs]


def test_frame_bucket_rounds_up_to_whole_buckets():
    assert [frame_bucket_of(n, 100) for n in (1, 100, 101, 250)] == [100, 100, 200, 300]


def test_the_earliest_deadline_leads_and_the_rest_follow_in_deadline_order():
    queued = [Job("late", 9.0), Job("first chunk", 1.0), Job("mid", 5.0)]
    assert names(pick_batch(queued, now=1.0, max_batch=16, frame_bucket=100, urgent_s=0.3)) == [
        "first chunk",
        "mid",
        "late",
    ]


def test_equal_deadlines_keep_arrival_order():
    queued = [Job("a", 2.0), Job("b", 2.0), Job("c", 2.0)]
    assert names(pick_batch(queued, 0.0, max_batch=2, frame_bucket=100, urgent_s=0.3)) == ["a", "b"]


def test_a_job_with_slack_does_not_drag_the_batch_into_a_longer_frame_bucket():
    # a new stream's first chunk (short mel) beside a stream with 6 s buffered and a long mel
    queued = [Job("buffered", 7.0, frames=640), Job("first", 1.0, frames=180)]
    assert names(pick_batch(queued, 1.0, 16, 100, 0.3)) == ["first"]
    # once the buffered one leads (the first chunk ran), it runs
    assert names(pick_batch(queued[:1], 1.2, 16, 100, 0.3)) == ["buffered"]


def test_a_job_with_slack_that_fits_the_bucket_rides_along():
    queued = [Job("buffered", 7.0, frames=160), Job("first", 1.0, frames=180)]
    assert names(pick_batch(queued, 1.0, 16, 100, 0.3)) == ["first", "buffered"]


def test_an_urgent_job_is_never_held_behind_ones_with_slack():
    # the head has slack; the urgent job is longer; jobs with slack fill the rest only if they fit
    queued = [Job("slack", 0.5, frames=90), Job("slack2", 0.6, frames=250), Job("urgent", 0.25, frames=380)]
    got = pick_batch(queued, now=0.0, max_batch=16, frame_bucket=100, urgent_s=0.3)
    assert got[0].name == "urgent"
    assert set(names(got)) == {"urgent", "slack", "slack2"}  # both fit the urgent job's 400-frame bucket
    # past its deadline (its client ran dry) it still joins the batch of an earlier-deadline head
    queued = [Job("head", 0.0, frames=90), Job("overdue", 0.1, frames=780), Job("slack", 5.0, frames=500)]
    assert names(pick_batch(queued, now=1.0, max_batch=16, frame_bucket=100, urgent_s=0.3)) == [
        "head",
        "overdue",
        "slack",
    ]  # the overdue one widened the bucket to 800, so the slack job fits now


def test_final_and_streaming_chunks_never_share_a_call():
    queued = [Job("final", 1.0, finalize=True), Job("stream", 1.1), Job("final2", 2.0, finalize=True)]
    assert names(pick_batch(queued, 1.0, 16, 100, 0.3)) == ["final", "final2"]


def test_the_batch_stops_at_max_batch_keeping_the_earliest():
    queued = [Job(str(i), float(10 - i)) for i in range(10)]
    assert names(pick_batch(queued, 0.0, 4, 100, 0.3)) == ["9", "8", "7", "6"]


def test_empty_queue_gives_an_empty_batch():
    assert pick_batch([], 0.0, 4, 100, 0.3) == []


def test_nobody_starves_under_a_steady_stream_of_first_chunks():
    """A long chunk with 5 s of slack, while every 0.1 s a new stream's short first chunk (deadline: its
    arrival) arrives and each batch takes 0.1 s: the long one runs once its deadline is the earliest, and
    not much after it."""
    clock = FakeClock()
    q: DeadlineQueue[Job] = DeadlineQueue(clock, max_batch=16, frame_bucket=100, urgent_s=0.3)
    q.put(Job("long", deadline=5.0, frames=700))
    ran_at = None
    for step in range(200):
        q.put(Job(f"first{step}", deadline=clock.now, frames=120))
        batch = q.take()
        assert batch is not None
        if "long" in names(batch):
            ran_at = clock.now
            break
        clock.now += 0.1
    assert ran_at is not None and 5.0 - 0.3 - 1e-9 <= ran_at <= 5.0 + 0.1  # urgent from 0.3 s before


def test_every_job_runs_exactly_once_in_a_random_load():
    import random

    rng = random.Random(0)
    clock = FakeClock()
    q: DeadlineQueue[Job] = DeadlineQueue(clock, max_batch=8, frame_bucket=100, urgent_s=0.3)
    queued, ran = set(), []
    for step in range(300):
        for k in range(rng.randrange(4)):
            job = Job(f"{step}.{k}", clock.now + rng.choice((0.0, 0.5, 3.0)), rng.randrange(50, 800))
            q.put(job)
            queued.add(job.name)
        if len(q):
            batch = q.take()
            assert batch is not None and len(batch) <= 8
            ran += names(batch)
        clock.now += 0.05
    while len(q):
        ran += names(q.take() or [])
    assert sorted(ran) == sorted(queued)


def test_take_blocks_until_a_put_and_returns_none_once_closed_and_empty():
    q: DeadlineQueue[Job] = DeadlineQueue(FakeClock(), max_batch=4)
    got: list[list[Job] | None] = []
    taker = threading.Thread(target=lambda: got.extend([q.take(), q.take()]))
    taker.start()
    q.put(Job("a", 0.0))
    q.close()
    taker.join(timeout=WAIT_S)
    assert not taker.is_alive()
    assert got[0] is not None and names(got[0]) == ["a"] and got[1] is None
    with pytest.raises(RuntimeError, match="closed"):
        q.put(Job("late", 0.0))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DeadlineQueue(FakeClock(), max_batch=0)


def test_out_of_phase_streams_meet_deadlines_that_arrival_order_misses():
    """Poisson arrivals at 8 streams/s of 5-15 chunks each (tests/engine/worker_sim.py): deadline batches
    keep every later chunk in time and first chunks short; arrival order pads first chunks to the buffered
    streams' long buckets and makes them wait behind work that had seconds to spare."""
    by_deadline = WorkerSim(rate=8.0).run()
    by_arrival = WorkerSim(rate=8.0).run(fifo=True)
    assert by_deadline.misses == 0 and by_arrival.misses > 10
    assert by_deadline.first_p95_s < 0.5 * by_arrival.first_p95_s
    assert by_deadline.served == by_arrival.served == 40
