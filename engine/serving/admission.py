"""Bounded admission: at most ``max_active`` requests compute, at most ``max_queue`` wait, the rest get Busy.

Waiters are futures on their own event loop, handed a slot in FIFO order when one frees (no polling).

Admission by SLO (``slack_guard_s``): a slot is not enough when the streams already admitted are about to run
dry. ``pressure`` reports the least playback slack (s) among the chunks waiting for the token2wav worker with
audio still buffered at their client and the clients playing past their first chunk (None: none); at or
under the guard, a new request is refused at once with a Retry-After estimated from the load (the mean time
a request holds its slot over the streams holding one: about when the next slot's worth of work is done), so
the admitted streams keep their promise instead of everyone stuttering.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.errors import Busy

RETRY_MIN_S, RETRY_MAX_S = 1.0, 60.0
RECENT_STARTS = 256  # slot takings remembered for ``started_within`` (more than any burst counts)
HELD_PRIOR_S = 10.0  # a request's slot time before any has finished (a 10 s stream at real time)


def no_pressure() -> float | None:
    return None


class Admission:
    def __init__(
        self,
        max_active: int,
        max_queue: int,
        pressure: Callable[[], float | None] = no_pressure,
        slack_guard_s: float | None = None,  # None: admit on slots alone
    ):
        if slack_guard_s is not None and slack_guard_s < 0:
            raise ValueError(f"slack_guard_s must be >= 0 or None, got {slack_guard_s}")
        self.max_active, self.max_queue = max_active, max_queue
        self.pressure, self.slack_guard_s = pressure, slack_guard_s
        self.active = 0
        self.held_s = HELD_PRIOR_S  # running mean of the slot time of finished requests (s)
        self._finished = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._starts: deque[float] = deque(maxlen=RECENT_STARTS)  # when slots were taken (clock s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last slot frees

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def retry_after_s(self) -> float:
        """When a refused request may expect a slot's worth of room: the mean slot time over the streams
        sharing the work, times the places ahead of it (the line and itself), in whole seconds."""
        streams = max(1, self.active)
        wait = self.held_s * (len(self._waiting) + 1) / streams
        return float(min(RETRY_MAX_S, max(RETRY_MIN_S, math.ceil(wait))))

    def overloaded(self) -> float | None:
        """The admitted streams' least slack (s) when it is at or under the guard, else None."""
        if self.slack_guard_s is None:
            return None
        slack = self.pressure()
        return slack if slack is not None and slack <= self.slack_guard_s else None

    async def acquire(self, timeout_s: float | None = None) -> None:
        """Take a slot, waiting in line if needed; Busy when the admitted streams are about to run dry, the
        line is full or the wait times out."""
        with self._lock:
            if (slack := self.overloaded()) is not None:
                raise Busy(
                    f"server at capacity: a running stream has {slack * 1000:.0f} ms of audio left",
                    retry_after_s=self.retry_after_s(),
                )
            if self.active < self.max_active and not self._waiting:
                self.active += 1
                self._starts.append(time.perf_counter())
                return
            if len(self._waiting) >= self.max_queue:
                raise Busy(
                    f"server busy: {self.active} streams running and {len(self._waiting)} waiting",
                    retry_after_s=self.retry_after_s(),
                )
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except (TimeoutError, asyncio.CancelledError) as err:
            self._leave(fut)
            if isinstance(err, TimeoutError):
                raise Busy(
                    "timed out waiting for a free stream slot", retry_after_s=self.retry_after_s()
                ) from None
            raise
        self.started(time.perf_counter())

    def started(self, now: float) -> None:
        """A request took its slot at ``now`` (``time.perf_counter`` s; ``acquire`` calls it):
        ``started_within`` counts it."""
        with self._lock:
            self._starts.append(now)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block (a worker thread, not the event loop) until no request holds a slot, at most ``timeout_s``
        -> whether none does."""
        with self._idle:
            return self._idle.wait_for(lambda: self.active == 0, timeout_s)

    def started_within(self, window_s: float, now: float) -> int:
        """The requests that took a slot within the last ``window_s`` seconds before ``now``."""
        with self._lock:
            return sum(1 for t in self._starts if now - t <= window_s)

    def _leave(self, fut: asyncio.Future[None]) -> None:
        """A waiter gave up: drop it from the line, or pass on the slot it was handed meanwhile."""
        with self._lock:
            if fut in self._waiting:
                self._waiting.remove(fut)
                return
        self.release()

    def release(self, held_s: float | None = None) -> None:
        """Free a slot; ``held_s``: how long the request held it (s), for the Retry-After estimate."""
        with self._lock:
            if held_s is not None and held_s >= 0:
                self._finished += 1
                self.held_s += (held_s - self.held_s) / min(self._finished, 32)  # the recent ones count most
            while self._waiting:
                fut = self._waiting.popleft()
                if not fut.done():
                    fut.get_loop().call_soon_threadsafe(_grant, fut)
                    return
            self.active -= 1
            if self.active == 0:
                self._idle.notify_all()


def _grant(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
