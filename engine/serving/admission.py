"""Bounded admission: at most ``max_active`` requests compute, at most ``max_queue`` wait, the rest get Busy.

Waiters are futures on their own event loop, handed a slot in FIFO order when one frees (no polling).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from engine.errors import Busy


class Admission:
    def __init__(self, max_active: int, max_queue: int):
        self.max_active, self.max_queue = max_active, max_queue
        self.active = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._lock = threading.Lock()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def acquire(self, timeout_s: float | None = None) -> None:
        """Take a slot, waiting in line if needed; Busy when the line is full or the wait times out."""
        with self._lock:
            if self.active < self.max_active and not self._waiting:
                self.active += 1
                return
            if len(self._waiting) >= self.max_queue:
                raise Busy(f"server busy: {self.active} streams running and {len(self._waiting)} waiting")
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except (TimeoutError, asyncio.CancelledError) as err:
            self._leave(fut)
            if isinstance(err, TimeoutError):
                raise Busy("timed out waiting for a free stream slot", retry_after_s=5.0) from None
            raise

    def _leave(self, fut: asyncio.Future[None]) -> None:
        """A waiter gave up: drop it from the line, or pass on the slot it was handed meanwhile."""
        with self._lock:
            if fut in self._waiting:
                self._waiting.remove(fut)
                return
        self.release()

    def release(self) -> None:
        with self._lock:
            while self._waiting:
                fut = self._waiting.popleft()
                if not fut.done():
                    fut.get_loop().call_soon_threadsafe(_grant, fut)
                    return
            self.active -= 1


def _grant(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
