"""Bounded admission: slots, FIFO hand-over, a full line is Busy, waiting can time out or be cancelled."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.errors import Busy
from engine.serving.admission import Admission
from tests.conftest import WAIT_S
from tests.engine.serving.worker_sim import WorkerSim


async def test_slots_then_fifo_then_busy():
    adm = Admission(max_active=2, max_queue=2)
    await adm.acquire()
    await adm.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        await adm.acquire()
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in (1, 2)]
    await asyncio.sleep(0.01)
    assert adm.active == 2 and adm.queued == 2
    with pytest.raises(Busy, match="busy"):
        await adm.acquire()  # the line is full
    adm.release()
    adm.release()
    await asyncio.gather(*waiters)
    assert order == [1, 2] and adm.active == 2 and adm.queued == 0


async def test_waiting_times_out_with_busy_and_leaves_the_line():
    adm = Admission(max_active=1, max_queue=4)
    await adm.acquire()
    with pytest.raises(Busy, match="timed out") as err:
        await adm.acquire(timeout_s=0.05)
    assert err.value.retry_after_s > 0 and adm.queued == 0
    adm.release()
    assert adm.active == 0


async def test_a_cancelled_waiter_gives_its_place_and_slot_back():
    adm = Admission(max_active=1, max_queue=4)
    await adm.acquire()
    first = asyncio.create_task(adm.acquire())
    second = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    assert adm.queued == 1
    adm.release()  # goes to the second waiter, not the cancelled one
    await asyncio.wait_for(second, 1)
    assert adm.active == 1
    adm.release()
    assert adm.active == 0 and adm.queued == 0


async def test_admission_by_slo_refuses_while_a_running_stream_is_close_to_running_dry():
    slack: list[float | None] = [None]
    adm = Admission(max_active=8, max_queue=8, pressure=lambda: slack[0], slack_guard_s=0.5)
    await adm.acquire()  # nothing buffered is waiting: slots decide
    slack[0] = 2.0
    await adm.acquire()  # seconds of audio left everywhere
    slack[0] = 0.4
    with pytest.raises(Busy, match="at capacity: a running stream has 400 ms") as err:
        await adm.acquire()
    assert adm.active == 2 and adm.queued == 0  # the refused request took nothing
    # Retry-After from the load: before any request finished, a 10 s slot time shared by 2 streams
    assert err.value.retry_after_s == 5.0
    adm.release(held_s=4.0)  # one finished after 4 s: the estimate follows (4 s over 1 stream)
    with pytest.raises(Busy) as err:
        await adm.acquire()
    assert err.value.retry_after_s == 4.0
    slack[0] = 0.6
    await adm.acquire()


async def test_admission_without_a_guard_ignores_the_pressure():
    adm = Admission(max_active=2, max_queue=0, pressure=lambda: -5.0, slack_guard_s=None)
    await adm.acquire()
    await adm.acquire()
    with pytest.raises(Busy, match="2 streams running") as err:
        await adm.acquire()
    assert err.value.retry_after_s == 5.0  # 10 s over 2 streams, first in line
    with pytest.raises(ValueError):
        Admission(1, 1, slack_guard_s=-1.0)


def test_admission_by_slo_refuses_before_any_admitted_stream_underruns_at_twice_capacity():
    """The worker model (tests/engine/worker_sim.py) at 6 streams/s, about twice what it serves without an
    underrun (3/s): admitting everyone makes streams stutter; the SLO guard refuses some arrivals and every
    admitted stream plays through."""
    everyone = WorkerSim(rate=6.0, per_row_s=0.008).run()
    assert everyone.misses > 50
    sim = WorkerSim(rate=6.0, per_row_s=0.008)
    adm = Admission(max_active=1000, max_queue=0, pressure=sim.pressure, slack_guard_s=1.5)
    guarded = sim.run(admit=lambda: adm.overloaded() is None)
    assert guarded.misses == 0 and 0 < guarded.refused < 20 and guarded.served == 40 - guarded.refused
    # well under capacity nobody is refused
    light = WorkerSim(rate=2.0, per_row_s=0.004)
    adm = Admission(max_active=1000, max_queue=0, pressure=light.pressure, slack_guard_s=1.5)
    assert light.run(admit=lambda: adm.overloaded() is None).refused == 0


def test_started_within_counts_the_slots_taken_in_the_window_only():
    adm = Admission(max_active=4, max_queue=0)
    assert adm.started_within(0.5, now=100.0) == 0
    for t in (99.0, 99.6, 99.9, 100.0):
        adm.started(t)
    assert adm.started_within(0.5, now=100.0) == 3  # 99.0 is 1 s ago
    assert adm.started_within(0.05, now=100.0) == 1 and adm.started_within(5.0, now=100.0) == 4
    assert adm.started_within(0.5, now=100.3) == 2  # the window moves with the clock


async def test_every_slot_taken_is_counted_as_a_start_at_once_or_after_waiting():
    adm = Admission(max_active=1, max_queue=1)
    await adm.acquire()  # at once
    waiter = asyncio.ensure_future(adm.acquire())  # in line
    await asyncio.sleep(0)
    assert adm.started_within(60.0, time.perf_counter()) == 1
    adm.release()
    await asyncio.wait_for(waiter, WAIT_S)
    assert adm.started_within(60.0, time.perf_counter()) == 2


async def test_wait_idle_returns_once_the_last_slot_frees_or_at_its_bound():
    """The graph builder's pace: a worker thread waits until no request holds a slot (the engine idle),
    at most its timeout; a slot handed to a waiter keeps the engine busy."""
    import threading

    adm = Admission(max_active=1, max_queue=1)
    assert adm.wait_idle(0.0)  # idle: at once
    await adm.acquire()
    t0 = time.monotonic()
    assert not adm.wait_idle(0.05) and time.monotonic() - t0 >= 0.05  # busy: the bound
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0.01)
    seen: list[bool] = []
    watcher = threading.Thread(target=lambda: seen.append(adm.wait_idle(WAIT_S)))
    watcher.start()
    adm.release()  # handed to the waiter: still one request running
    await waiter
    await asyncio.sleep(0.05)
    assert seen == [] and adm.active == 1
    adm.release()  # the last one: idle now
    await asyncio.to_thread(watcher.join, WAIT_S)
    assert seen == [True]
