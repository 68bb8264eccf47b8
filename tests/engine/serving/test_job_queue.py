"""The token2wav queue's batch order (earliest deadline first, frame buckets, urgency) and starvation
freedom, on a fake clock: no sleeps, no threads except where ``take`` blocks."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from engine.serving.call_cost import CallCost
from engine.serving.job_queue import DeadlineQueue, Hold, Relaxed, frame_bucket_of, pick_batch
from tests.conftest import WAIT_S
from tests.engine.serving.worker_sim import WorkerSim


@dataclass(frozen=True)
class Job:
    name: str
    deadline: float
    frames: int = 150
    finalize: bool = False
    first: bool = False


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


def test_take_urgent_takes_a_batch_only_when_its_head_is_urgent_and_never_blocks():
    """At a call's seam the worker asks for urgent work: a queue of chunks with slack has none (and keeps
    them); a first chunk (due when queued) makes one, taken with what rides along."""
    clock = FakeClock()
    q: DeadlineQueue[Job] = DeadlineQueue(clock, max_batch=4, urgent_s=0.3)
    assert q.take_urgent() is None  # empty: no wait
    q.put(Job("buffered", 5.0))
    assert q.take_urgent() is None and len(q) == 1
    q.put(Job("first", 0.0))
    assert names(q.take_urgent() or []) == ["first", "buffered"]  # it fits the first's bucket: rides along
    q.put(Job("soon", 0.5))
    clock.now = 0.25  # 0.25 s of slack left: urgent now
    assert names(q.take_urgent() or []) == ["soon"] and len(q) == 0


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


def test_relaxed_jobs_fill_a_batch_only_within_the_budget():
    """Three streams with 5 s buffered and a fourth with 1 s: under a 2,000 row-frame budget two relaxed
    800-frame rows fit beside the head; the one with little slack joins whatever the budget."""
    queued = [Job(f"r{i}", 5.0 + i, frames=750) for i in range(3)] + [Job("near", 1.0, frames=780)]
    assert names(pick_batch(queued, 0.0, 16, 100, 0.3, relaxed_s=2.0, budget=2000)) == ["near", "r0"]
    assert names(pick_batch(queued, 0.0, 16, 100, 0.3, relaxed_s=2.0, budget=3200)) == [
        "near",
        "r0",
        "r1",
        "r2",
    ]
    # without the rule (the scheduler before), every row that fits the bucket rides along
    assert names(pick_batch(queued, 0.0, 16, 100, 0.3)) == ["near", "r0", "r1", "r2"]
    # a relaxed head runs even when it alone is over the budget; urgent rows ignore the budget
    queued = [
        Job("relaxed", 9.0, frames=900),
        Job("urgent", 0.2, frames=900),
        Job("urgent2", 0.25, frames=900),
    ]
    assert names(pick_batch(queued, 0.0, 16, 100, 0.3, 2.0, budget=100)) == ["urgent", "urgent2"]
    assert names(pick_batch(queued[:1], 0.0, 16, 100, 0.3, 2.0, budget=100)) == ["relaxed"]


def test_the_queue_takes_its_budget_from_the_measured_call_cost():
    clock = FakeClock()
    cost = CallCost()
    q: DeadlineQueue[Job] = DeadlineQueue(clock, max_batch=16, relaxed=Relaxed(2.0, 0.2, cost))
    for i in range(4):
        q.put(Job(f"r{i}", 5.0, frames=450))  # 500-frame bucket
    # nothing measured yet: no budget, the relaxed rows fill the batch
    assert names(q.take() or []) == ["r0", "r1", "r2", "r3"]
    cost.observe(rows=4, bucket_frames=500, seconds=0.4)  # 2e-4 s a row-frame: 1,000 in 0.2 s
    for i in range(4):
        q.put(Job(f"s{i}", 5.0, frames=450))
    assert names(q.take() or []) == ["s0", "s1"]
    with pytest.raises(ValueError):
        DeadlineQueue(clock, max_batch=16, urgent_s=0.3, relaxed=Relaxed(0.1))


def test_out_of_phase_streams_keep_their_deadlines_and_first_chunks_stop_waiting_behind_buffered_ones():
    """The same Poisson load at 6 streams/s, three schedulers: arrival order misses deadlines; earliest
    deadline first meets them all but a first chunk often lands behind a long call of chunks that had
    seconds to spare; keeping such calls short (the relaxed rule, its cost learnt from the batches) meets
    them all too and cuts the first chunks' p95 wait to under 0.6 x."""
    by_arrival = WorkerSim(rate=6.0).run(fifo=True)
    before = WorkerSim(rate=6.0).run()
    relaxed = WorkerSim(rate=6.0).run(relaxed=Relaxed())
    assert by_arrival.misses > 10
    assert before.misses == relaxed.misses == 0
    assert relaxed.first_p95_s < 0.6 * before.first_p95_s
    assert before.served == relaxed.served == 40


def test_the_relaxed_rule_holds_only_while_its_condition_says_so():
    """auto's gate (``when``): with no stream short of audio the relaxed rows fill the batch as before the
    rule; with one, the call is kept to the measured budget."""
    clock, cost, thin = FakeClock(), CallCost(), [False]
    cost.observe(rows=4, bucket_frames=500, seconds=0.4)  # 1,000 row-frames in 0.2 s
    q: DeadlineQueue[Job] = DeadlineQueue(
        clock, max_batch=16, relaxed=Relaxed(2.0, 0.2, cost), when=lambda: thin[0]
    )
    for i in range(4):
        q.put(Job(f"r{i}", 5.0, frames=450))
    assert names(q.take() or []) == ["r0", "r1", "r2", "r3"]
    thin[0] = True
    for i in range(4):
        q.put(Job(f"s{i}", 5.0, frames=450))
    assert names(q.take() or []) == ["s0", "s1"]


def test_auto_keeps_a_waves_full_batches_and_random_arrivals_short_calls():
    """The relaxed rule always on shortens the first chunks' waits under random arrivals but splits a
    synchronized wave's calls once every stream has seconds buffered, so the wave ends later; auto (the
    rule while a stream that has arrived has under 2 s buffered) does the first as well and the second
    as fast as without the rule."""
    off, on = WorkerSim(rate=6.0).run(), WorkerSim(rate=6.0).run(relaxed=Relaxed())
    auto = WorkerSim(rate=6.0).run(relaxed=Relaxed(), auto=True)
    assert off.misses == on.misses == auto.misses == 0
    assert on.first_p95_s < 0.6 * off.first_p95_s and auto.first_p95_s < 0.6 * off.first_p95_s
    wave = dict(rate=1e4, streams=16, chunks=20, seed=1)
    w_off, w_on = WorkerSim(**wave).run(), WorkerSim(**wave).run(relaxed=Relaxed())
    w_auto = WorkerSim(**wave).run(relaxed=Relaxed(), auto=True)
    assert w_off.misses == w_on.misses == w_auto.misses == 0
    assert w_on.end_s > 1.08 * w_off.end_s  # the always-on rule's price: more, shorter calls
    assert w_auto.end_s < 1.01 * w_off.end_s


def test_holding_the_worker_for_a_first_chunk_helps_a_light_load_and_costs_misses_near_capacity():
    """The design the trace suggested, the engine's opt-in quiet-first hold (worker_sim's ``hold_s``, an LM
    that the worker does not slow): idling the worker while a request waits for its first chunk and
    everyone else has seconds buffered. At 1 stream/s the first chunks' p95 falls; at 4/s, near this
    worker's capacity, the idle time is capacity lost and later chunks miss more of their deadlines."""
    light = dict(rate=1.0, streams=100)
    assert WorkerSim(**light).run(relaxed=Relaxed(), auto=True, hold_s=0.2).first_p95_s < 0.9 * (
        WorkerSim(**light).run(relaxed=Relaxed(), auto=True).first_p95_s
    )
    busy = dict(rate=4.0, streams=100)
    held = WorkerSim(**busy).run(relaxed=Relaxed(), auto=True, hold_s=0.2)
    plain = WorkerSim(**busy).run(relaxed=Relaxed(), auto=True)
    assert held.misses > 1.5 * plain.misses > 0
    assert held.served == plain.served == 100


def test_the_seam_cuts_the_first_chunks_wait_at_every_load_and_costs_nobody_a_deadline():
    """The engine's yield (worker_sim's ``seam``): a first chunk queued during a call of chunks with
    seconds to spare runs between that call's flow and its vocoder. Its p95 falls from 1 to 6 streams/s,
    no later chunk misses a deadline it met without (the rows set aside had seconds to spare), and a
    synchronized wave, which has no first chunk during such a call, ends as soon."""
    for rate in (1.0, 2.0, 3.0, 6.0):
        whole = WorkerSim(rate=rate).run(relaxed=Relaxed(), auto=True)
        seam = WorkerSim(rate=rate).run(relaxed=Relaxed(), auto=True, seam=True)
        assert seam.first_p95_s < 0.9 * whole.first_p95_s, rate
        assert seam.misses <= whole.misses and seam.served == whole.served == 40
    wave = dict(rate=1e4, streams=16, chunks=20, seed=1)
    w_whole = WorkerSim(**wave).run(relaxed=Relaxed(), auto=True)
    w_seam = WorkerSim(**wave).run(relaxed=Relaxed(), auto=True, seam=True)
    assert w_seam.misses == w_whole.misses == 0 and w_seam.end_s == pytest.approx(w_whole.end_s)


# ------------------------------------------------ the quiet-first hold (EngineConfig.t2w_quiet_first)


def test_the_hold_waits_out_the_least_spare_slack_or_the_bound_and_never_an_urgent_row():
    """``Hold.wait_s``: relaxed rows (6 s of slack over 2 s) wait until the bound (0.25 s from the hold's
    start); rows near the threshold until their slack falls to it; a batch with an urgent or near row not
    at all."""
    hold = Hold(slack_s=2.0, bound_s=0.25)
    relaxed = [Job("r0", 6.0), Job("r1", 7.0)]
    assert hold.wait_s(relaxed, now=0.0, since=0.0) == pytest.approx(0.25)
    assert hold.wait_s(relaxed, now=0.2, since=0.0) == pytest.approx(0.05)
    assert hold.wait_s(relaxed, now=0.3, since=0.0) <= 0  # the bound passed
    assert hold.wait_s([Job("near", 2.1)], now=0.0, since=0.0) == pytest.approx(0.1)
    assert hold.wait_s([Job("first", 0.0), *relaxed], now=0.0, since=0.0) == 0.0
    assert hold.wait_s([Job("two s", 2.0)], now=0.0, since=0.0) == 0.0  # at the threshold: runs
    with pytest.raises(ValueError):
        Hold(slack_s=2.0, bound_s=0.0)


class Taker:
    """``take`` on a thread of its own: each batch it took, in order, and an event per batch."""

    def __init__(self, q: DeadlineQueue[Job], takes: int):
        self.q, self.got = q, []
        self.took = [threading.Event() for _ in range(takes)]
        self.thread = threading.Thread(target=self._run, args=(takes,), daemon=True)
        self.thread.start()

    def _run(self, takes: int) -> None:
        for i in range(takes):
            self.got.append(self.q.take())
            self.took[i].set()

    def batch(self, i: int) -> list[str]:
        assert self.took[i].wait(WAIT_S), f"take {i} never returned"
        batch = self.got[i]
        return names(batch) if batch is not None else ["(closed)"]


def quiet_queue(clock: FakeClock, bound_s: float = 0.25) -> DeadlineQueue[Job]:
    return DeadlineQueue(clock, max_batch=16, frame_bucket=100, hold=Hold(2.0, bound_s))


def test_a_relaxed_batch_waits_while_a_first_chunk_is_decoded_and_runs_after_it():
    """A chunk with 6 s buffered is queued while a request decodes its first chunk: the worker holds it;
    the first chunk queued (its ticket ended with it) runs first, alone in its 100-frame bucket, then the
    held one. Nothing is decoding after."""
    clock = FakeClock()
    q = quiet_queue(clock)
    first = q.first_chunk()
    q.put(Job("buffered", 6.0, frames=640))
    taker = Taker(q, 2)
    assert q.holding.wait(WAIT_S) and not taker.took[0].is_set()
    q.put(Job("first", 0.0, frames=80), first)
    assert taker.batch(0) == ["first"] and taker.batch(1) == ["buffered"]
    assert q.decoding == 0 and not first.open and not q.holding.is_set()


def test_an_urgent_batch_is_never_held():
    """With a first chunk being decoded: a stream about to run dry (0.2 s), then one with 1 s buffered
    (under the 2 s threshold) are taken at once, the latter with a relaxed row that fits its bucket (a batch
    is held only when all its rows are relaxed)."""
    clock = FakeClock()
    q = quiet_queue(clock)
    q.first_chunk()
    q.put(Job("dry soon", 0.2))
    q.put(Job("relaxed", 6.0, frames=640))  # a longer bucket: not in the urgent one's batch
    q.put(Job("near", 1.0, frames=900))
    taker = Taker(q, 2)
    assert taker.batch(0) == ["dry soon"] and taker.batch(1) == ["near", "relaxed"]
    assert not q.holding.is_set() and q.decoding == 1


def test_the_hold_ends_at_its_bound():
    """No first chunk comes: once the clock passes 0.25 s from the hold's start the batch runs, the
    request still decoding."""
    clock = FakeClock()
    q = quiet_queue(clock)
    q.first_chunk()
    q.put(Job("buffered", 6.0))
    taker = Taker(q, 1)
    assert q.holding.wait(WAIT_S)
    clock.now = 0.26
    assert taker.batch(0) == ["buffered"] and q.decoding == 1


def test_the_hold_ends_when_the_rows_slack_falls_to_the_threshold():
    """A long bound (10 s), a row with 2.5 s of slack: it waits 0.5 s, down to the 2 s threshold, no more."""
    clock = FakeClock()
    q = quiet_queue(clock, bound_s=10.0)
    q.first_chunk()
    q.put(Job("buffered", 2.5))
    taker = Taker(q, 1)
    assert q.holding.wait(WAIT_S)
    clock.now = 0.5
    assert taker.batch(0) == ["buffered"]


def test_a_ticket_ended_without_its_chunk_releases_the_hold_and_counts_once():
    """A request that fails or is aborted before its first chunk ends its ticket: the held batch runs at
    once; ending it again (or queueing a chunk with it) uncounts nothing more."""
    clock = FakeClock()
    q = quiet_queue(clock)
    gone, still = q.first_chunk(), q.first_chunk()
    assert q.decoding == 2
    q.put(Job("buffered", 6.0))
    taker = Taker(q, 2)
    assert q.holding.wait(WAIT_S)
    gone.end()
    gone.end()
    assert q.decoding == 1 and not taker.took[0].is_set()  # the other one still holds it
    still.end()
    assert taker.batch(0) == ["buffered"] and q.decoding == 0
    q.put(Job("later", 6.0), gone)
    assert taker.batch(1) == ["later"] and q.decoding == 0


def test_switching_the_hold_off_and_closing_release_a_held_take():
    clock = FakeClock()
    q = quiet_queue(clock)
    q.first_chunk()
    q.put(Job("a", 6.0))
    taker = Taker(q, 3)
    assert q.holding.wait(WAIT_S)
    hold, q.hold = q.hold, None
    assert taker.batch(0) == ["a"]
    q.hold = hold
    q.put(Job("b", 6.0))
    assert q.holding.wait(WAIT_S)
    q.close()
    assert taker.batch(1) == ["b"] and taker.batch(2) == ["(closed)"]


def test_without_the_hold_a_relaxed_batch_runs_while_a_first_chunk_is_decoded():
    q: DeadlineQueue[Job] = DeadlineQueue(FakeClock(), max_batch=16)
    q.first_chunk()
    q.put(Job("buffered", 6.0))
    assert Taker(q, 1).batch(0) == ["buffered"] and not q.holding.is_set()


def test_the_first_chunk_lane_takes_first_chunks_alone_only_while_open():
    """``take_first`` (the first-chunk lane's take) waits while the lane is closed, then hands out first
    chunks one at a time, earliest deadline first, and never a later chunk; the main take may still take
    first chunks; closing the queue ends the lane's wait with None."""
    clock = FakeClock()
    q: DeadlineQueue[Job] = DeadlineQueue(clock, max_batch=4)
    q.put(Job("later", 0.5))
    q.put(Job("first b", 0.2, first=True))
    q.put(Job("first a", 0.1, first=True))
    got: list[list[Job] | None] = []
    two = threading.Semaphore(0)

    def takes() -> None:
        for _ in range(3):
            got.append(q.take_first())
            two.release()

    lane = threading.Thread(target=takes)
    lane.start()
    lane.join(timeout=0.2)
    assert lane.is_alive() and got == []  # closed: nothing taken
    q.lane_open = True
    assert two.acquire(timeout=WAIT_S) and two.acquire(timeout=WAIT_S)
    assert [names(batch or []) for batch in got] == [["first a"], ["first b"]]
    assert names(q.snapshot()) == ["later"]
    q.lane_open = False
    q.put(Job("first c", 0.3, first=True))
    assert names(q.take() or []) == ["first c", "later"]  # the main take takes first chunks too
    q.close()
    lane.join(timeout=WAIT_S)
    assert not lane.is_alive() and got[2] is None
