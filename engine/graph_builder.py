"""Work that makes a serving engine faster but is not needed to serve correctly (the CUDA graphs beyond
the first of each kind), queued at load and run on one background thread once the engine is ready, or
earlier (``begin``) where the load would only wait for the LM backend's start.

Requests never wait for it: a shape whose graph is not captured yet replays a wider captured graph of its
kind (``GraphCache.covering``), or runs uncaptured on its padded bucket shape: the same computation.
Each job is a phase on the start-up timeline.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from engine.serving.startup import Timeline

log = logging.getLogger(__name__)
Job = Callable[[threading.Event], None]  # runs to the end, or returns early once the event is set
# Between two captures a job waits this long at most for the engine's pace (``yield_to``): a capture is
# Python-heavy (an uncaptured solve run twice, then recorded), and a request's uncaptured calls beside it
# run op by op, each waiting for the interpreter. A short bound lets captures go on through a burst of
# arrivals and starve streams (BENCHMARKS.md, "Soak"); the bound only keeps a load that never leaves room
# from holding the engine off full speed for ever
CAPTURE_WAIT_S = 30.0
PACE_SLICE_S = 1.0  # asked in slices this long, so that a stop (the engine closing) ends the wait at once
STOP_WAIT_S = 10.0  # close() waits this long for a capture in flight (a warm one takes ~1 s)
# While the jobs run (tens of seconds of Dynamo/Inductor Python), a serving thread that wants the interpreter
# gets it after this long instead of Python's 5 ms: a request's path hands the GIL over hundreds of times
BACKGROUND_SWITCH_S = 0.0005


class Pace(threading.Event):
    """The stop event handed to every job; ``between()``, called between two of its captures, also waits
    (``CAPTURE_WAIT_S`` at most) until ``clear_for_capture`` says a capture would harm no request, once
    ``yield_to`` has set it."""

    def __init__(self) -> None:
        super().__init__()
        self.clear_for_capture: Callable[[float], bool] | None = None

    def between(self) -> None:
        if self.clear_for_capture is None:
            return
        deadline = time.monotonic() + CAPTURE_WAIT_S
        while not self.is_set() and (left := deadline - time.monotonic()) > 0:
            if self.clear_for_capture(min(left, PACE_SLICE_S)):
                return


class GraphBuilder:
    """Jobs added at load (``add``), run in order on one daemon thread: from ``start`` (the engine is
    ready: nothing more is added), or from ``begin`` (jobs added after it join the queue until ``start``)."""

    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self._jobs: list[tuple[str, Job]] = []
        self._next = 0  # the index in _jobs of the next job to run
        self._sealed = False  # start() came: no job is added after it, the thread ends with the queue
        self._queue = threading.Condition()  # guards the three above; the thread waits on it for jobs
        self._stop, self._done = Pace(), threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, job: Job) -> None:
        with self._queue:
            if self._sealed:
                raise RuntimeError("the graph builder has started: add its jobs at load")
            self._jobs.append((name, job))
            self.timeline.queue(name)  # pending on /ready from now until it has run (queued before it runs)
            self._queue.notify()

    @property
    def pending(self) -> int:
        """Jobs not yet finished (0 once all ran, or when there were none)."""
        return 0 if self._done.is_set() else len(self._jobs)

    def yield_to(self, clear: Callable[[float], bool]) -> None:
        """``clear(timeout_s) -> bool`` (the engine: waits, at most ``timeout_s``, until a capture can
        delay no stream into a stall -> True then, False at the bound) paces the captures from now on."""
        self._stop.clear_for_capture = clear

    def begin(self) -> None:
        """Run the queued jobs now, before the engine is ready (the load has seconds to wait for the LM
        backend's start), and those added later until ``start``; later calls do nothing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="graph-builder", daemon=True)
            self._thread.start()

    def start(self) -> None:
        """No more jobs: run them on a background thread (begun here unless ``begin`` came first), which
        ends with the last; later calls do nothing."""
        with self._queue:
            self._sealed = True
            self._queue.notify()
        self.begin()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every job has run (benchmarks measure the finished engine) -> whether they have."""
        return self._done.wait(timeout_s)

    def stop(self) -> None:
        """Ask the running job to return after its current capture, and wait for it a little."""
        self._stop.set()
        with self._queue:
            self._queue.notify()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)

    def _run(self) -> None:
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, BACKGROUND_SWITCH_S))
        try:
            while (queued := self._taken()) is not None:
                self._one(*queued)
        finally:
            sys.setswitchinterval(switch)
            self._done.set()

    def _taken(self) -> tuple[str, Job] | None:
        """The next job, waiting for one until ``start`` seals the queue; None: no more (or a stop)."""
        with self._queue:
            self._queue.wait_for(lambda: self._stop.is_set() or self._sealed or self._next < len(self._jobs))
            if self._stop.is_set() or self._next == len(self._jobs):
                return None
            self._next += 1
            return self._jobs[self._next - 1]

    def _one(self, name: str, job: Job) -> None:
        """One job; a failure is logged and the engine keeps serving on what it has (graphs are an
        optimisation: the shapes they would cover run uncaptured, exactly as before)."""
        try:
            with self.timeline.phase(name, background=True):
                job(self._stop)
        except Exception:
            log.exception("%s failed in the background; the engine serves on what it has", name)
