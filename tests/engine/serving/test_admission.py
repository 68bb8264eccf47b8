"""Bounded admission: slots, FIFO hand-over, a full line is Busy, waiting can time out or be cancelled."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import Busy
from engine.serving.admission import Admission


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
