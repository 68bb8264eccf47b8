"""Serve within seconds, upgrade in place: an LM backend that answers on a first backend (the native loop,
up as soon as the weights are) while a second one starts (vLLM: tens of seconds), then hands over to it.

Each request (a ``generate`` from its first pull, a bistream ``session`` from its creation) is routed once,
under one lock, to the backend serving new requests at that instant, and runs to its end there: none is
moved, so none is lost or decoded twice at the switch. From the switch on, new requests go to the second
backend while those in flight on the first finish on it; once the last has, the first is closed (its decode
thread ends, its KV caches go) and ``release`` runs (the engine empties the device's cache). Both backends
sample with the same RAS code, seeded per request (engine.lm.sampling), so a request's tokens do not
depend on which of the two served it.

Before the switch the second backend decodes a few tokens of the first request the handover routed (a
rehearsal, on the event loop that request ran on): a backend's first request pays for its lazy set-up (vLLM:
its output loop, the first prompt-embeds prefill and sampling; ~250 ms more to first audio on the H200), and
a visitor no longer does. Nothing routed yet (vLLM up before the engine's own warm-up): no rehearsal, the
warm-up request is the second's first.

If the second backend fails to start or to rehearse, the first keeps serving (logged): slower, but
serving. The timeline (``engine.serving.startup``) shows the handover as a background phase, pending from
the start: ``/ready`` reads "warming" until the first backend is retired.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from engine.lm.backend import LMBackend, LMRequest
from engine.lm.bistream import LMSession, Round
from engine.serving.startup import Timeline

log = logging.getLogger(__name__)
PHASE = "LM handover"  # from construction to the first backend's retirement, on the timeline
REHEARSAL_TOKENS = 8  # decode steps of the rehearsal: its prefill and a few steps pay the first-request costs
REHEARSAL_S = 60.0  # a rehearsal that has not ended by then counts as failed (8 steps take ~0.3 s on an H200)


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What the second backend decodes before the switch: a shortened copy of a routed request, on the event
    loop that request ran on (vLLM binds its output loop to the loop of its first request)."""

    request: LMRequest
    loop: asyncio.AbstractEventLoop

    @classmethod
    def of(cls, req: LMRequest, loop: asyncio.AbstractEventLoop) -> Rehearsal:
        steps = min(req.max_len, REHEARSAL_TOKENS)
        short = dataclasses.replace(
            req, request_id=f"{req.request_id}-rehearsal", min_len=min(req.min_len, steps), max_len=steps
        )
        return cls(short, loop)


class StartGate:
    """Holds the second backend's start until the engine is ready (``EngineConfig.lm_start_after_ready``):
    its start is Python in this process (vLLM's import, its engine arguments) that would otherwise share the
    interpreter with the load's own (the weights, the first graphs, the studio's import). ``cancel`` (a
    failed load, an engine closed first) lets the waiting start end without starting anything."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()  # open and cancel may race (the first request's warm-up, a close)
        self._cancelled = False

    def open(self) -> None:
        """The engine is ready: the start goes on (later calls, and a call after ``cancel``, do nothing)."""
        with self._lock:
            self._event.set()

    def cancel(self) -> None:
        """No start from now on, where it has not been let go already."""
        with self._lock:
            if not self._event.is_set():
                self._cancelled = True
                self._event.set()

    def wait(self) -> None:
        """Block until opened; raises ``GateCancelled`` where cancelled first."""
        self._event.wait()
        if self._cancelled:
            raise GateCancelled("the engine closed before it was ready: the LM backend was not started")


class GateCancelled(RuntimeError):
    """A gated start that was never to run (the first backend keeps serving, or the engine is gone)."""


class HandoverLM:
    """``first`` serves until ``second`` (a future: its start runs elsewhere) is up, then ``second``."""

    def __init__(
        self,
        first: LMBackend,
        second: Future[LMBackend],
        timeline: Timeline | None = None,
        release: Callable[[], object] | None = None,
        gate: StartGate | None = None,
    ):
        """``gate``: what ``second``'s start waits for, if anything (cancelled by ``close``)."""
        self.first, self._second, self._gate = first, second, gate
        self.timeline, self._release = timeline or Timeline(), release
        self._lock = threading.Lock()
        self._serving: LMBackend = first  # the backend new requests go to
        self._on_first = 0  # requests routed to the first backend and not yet ended
        self._switched = threading.Event()  # new requests go to the second backend
        self._drained = threading.Event()  # the switch has happened and nothing is left on the first
        self._closed = False
        self._rehearsal: Rehearsal | None = None  # set by the first request routed to the first backend
        self.timeline.queue(PHASE)  # pending from now: /ready never reads steady before the handover
        self._thread = threading.Thread(target=self._upgrade, name="lm-handover", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        """The backend new requests go to now."""
        return self._serving.name

    @property
    def upgraded(self) -> bool:
        """New requests go to the second backend."""
        return self._serving is not self.first

    def wait_upgraded(self, timeout_s: float | None = None) -> bool:
        """Block until new requests go to the second backend (True), or ``timeout_s`` passed (False)."""
        return self._switched.wait(timeout_s)

    def wait_settled(self, timeout_s: float | None = None) -> bool:
        """Block until the handover is over (the first retired, or kept after a failed start) -> True."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def retired(self) -> bool:
        """The first backend has been closed (its requests all ended after the switch)."""
        return self._drained.is_set() and not self._thread.is_alive()

    @property
    def active(self) -> int:
        busy = 0 if self.retired else self.first.active
        return busy + (self._serving.active if self.upgraded else 0)

    @property
    def healthy(self) -> bool:
        return self._serving.healthy

    async def generate(self, req: LMRequest) -> AsyncIterator[int]:
        backend = self._take()
        if backend is self.first and self._rehearsal is None:
            self._rehearsal = Rehearsal.of(req, asyncio.get_running_loop())
        try:
            ids = backend.generate(req)
            async with contextlib.aclosing(ids) as tokens:  # type: ignore[type-var]
                async for tok in tokens:
                    yield tok
        finally:
            self._give_back(backend)

    def session(self, request_id: str, seed: int) -> LMSession:
        backend = self._take()
        try:
            inner = backend.session(request_id, seed)
        except BaseException:
            self._give_back(backend)
            raise
        return _HeldSession(inner, lambda: self._give_back(backend))

    def close(self) -> None:
        """Close both: the first now, the second once its start has ended (a vLLM engine core started
        meanwhile must not outlive the server)."""
        with self._lock:
            self._closed = True
        self._drained.set()
        if self._gate is not None:  # a start still held never runs
            self._gate.cancel()
        self.first.close()
        self._second.add_done_callback(_close_started)

    def _take(self) -> LMBackend:
        with self._lock:
            backend = self._serving
            if backend is self.first:
                self._on_first += 1
            return backend

    def _give_back(self, backend: LMBackend) -> None:
        with self._lock:
            if backend is not self.first:
                return
            self._on_first -= 1
            if self.upgraded and self._on_first == 0:
                self._drained.set()

    def _upgrade(self) -> None:
        """Wait for the second backend, switch new requests to it, retire the first once drained."""
        try:
            second = self._second.result()
        except GateCancelled:  # closed before the gate opened: nothing started, nothing to hand over
            log.info("the %s LM backend served to the end: its successor was never started", self.first.name)
            return
        except BaseException:  # the start failed: the first keeps serving
            log.exception("the %s LM backend keeps serving: its successor failed to start", self.first.name)
            second = None
        with self.timeline.phase(PHASE, background=True):
            if second is None or not self._rehearsed(second) or not self._switch(second):
                return
            self._drained.wait()
            if self._closed:
                return
            self.first.close()
            if self._release is not None:
                self._release()
        log.info("the %s LM backend serves every request; the %s one is closed", second.name, self.first.name)

    def _rehearsed(self, second: LMBackend) -> bool:
        """The rehearsal on ``second`` -> False (and ``second`` closed) when it failed."""
        rehearsal, began = self._rehearsal, time.monotonic()
        if rehearsal is None:
            return True
        if not rehearsal.loop.is_running():  # a caller's own loop, stopped or closed: it would never run
            log.info("no rehearsal on %s: the loop of the first request is not running", second.name)
            return True
        try:
            tokens = _count(second.generate(rehearsal.request))
            done = asyncio.run_coroutine_threadsafe(tokens, rehearsal.loop)
        except RuntimeError:  # its loop closed since: nothing to rehearse on
            tokens.close()
            log.info("no rehearsal on %s: the loop of the first request has closed", second.name)
            return True
        try:
            n = done.result(REHEARSAL_S)
        except Exception:  # the backend's error, or no end in time: it cannot be trusted with requests
            done.cancel()
            if not self._closed:
                first = self.first.name
                log.exception("the %s LM backend keeps serving: %s failed its rehearsal", first, second.name)
            second.close()
            return False
        log.info("%s rehearsed %d tokens in %.2f s", second.name, n, time.monotonic() - began)
        return True

    def _switch(self, second: LMBackend) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._serving = second
            left = self._on_first
            if left == 0:
                self._drained.set()
        self._switched.set()
        log.info("new LM requests go to %s; %d finish on %s", second.name, left, self.first.name)
        return True


async def _count(tokens: AsyncIterator[int]) -> int:
    async with contextlib.aclosing(tokens) as each:  # type: ignore[type-var]
        return sum([1 async for _ in each])


def _close_started(started: Future[LMBackend]) -> None:
    if not started.cancelled() and started.exception() is None:
        started.result().close()


class _HeldSession:
    """A bistream session on the backend it was routed to; its end gives its place back (once)."""

    def __init__(self, inner: LMSession, done: Callable[[], None]):
        self.inner, self._done = inner, done
        self._ended = False

    def round(self, rnd: Round) -> AsyncIterator[int]:
        return self.inner.round(rnd)

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            if not self._ended:
                self._ended = True
                self._done()
