"""The start-up timeline: each phase of bringing a server up (weights, the LM backend, graph captures,
warm-up...) with its seconds since launch, logged as it starts and ends and read back by ``/ready``.

Stdlib only, so the launch instant is taken when the server's entry point first imports this module,
before torch, vLLM or Gradio load. Phases may run in threads (the LM backend beside the frontends,
graph captures behind a serving engine): the timeline is shared and locked.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.serving import phase_profile

log = logging.getLogger(__name__)
LAUNCH = time.monotonic()  # the process's launch, as near as this module can see it (its first import)


@dataclass(frozen=True)
class Phase:
    """One finished phase: seconds since launch when it began, how long it took, whether it ran after
    the server was ready (background work requests do not wait for)."""

    name: str
    start_s: float
    seconds: float
    background: bool = False

    def __post_init__(self) -> None:
        if not self.name or self.seconds < 0:
            raise ValueError(f"a phase needs a name and seconds >= 0, got {self.name!r} {self.seconds}")


class Timeline:
    """Phases in the order they ended, the ready instant, and the phases still running."""

    def __init__(
        self,
        origin: float = LAUNCH,
        clock: Callable[[], float] = time.monotonic,
        profile_to: Path | None = None,
    ):
        """``profile_to``: each phase's thread sampled while it runs, written there (``phase_profile``)."""
        self.origin, self.clock, self.profile_to = origin, clock, profile_to
        self._lock = threading.Lock()
        self._phases: list[Phase] = []
        self._running: dict[int, str] = {}  # token -> name, for what /ready lists as pending
        self._queued: list[str] = []  # phases announced to run later (background jobs), pending too
        self._tokens = itertools.count()
        self._ready_s: float | None = None

    def now_s(self) -> float:
        """Seconds since launch."""
        return self.clock() - self.origin

    @contextlib.contextmanager
    def phase(self, name: str, background: bool = False) -> Iterator[None]:
        """Time the block as phase ``name``; a block that raises is not recorded (the load failed)."""
        start = self.now_s()
        with self._lock:
            token = next(self._tokens)
            self._running[token] = name
            if name in self._queued:
                self._queued.remove(name)
        log.info("start-up: %s... (%.1f s since launch)", name, start)
        try:
            with self._profiled(name, start):
                yield
            self.record(name, start, self.now_s() - start, background)
        finally:
            with self._lock:
                self._running.pop(token, None)

    @contextlib.contextmanager
    def _profiled(self, name: str, start_s: float) -> Iterator[None]:
        """The block's thread sampled into ``profile_to`` (written even where the block raises)."""
        if self.profile_to is None:
            yield
            return
        sampler = phase_profile.PhaseProfile(threading.get_ident())
        sampler.start()
        try:
            yield
        finally:
            stacks = sampler.stop()
            stem = phase_profile.file_stem(start_s, name)
            try:
                path = phase_profile.write(stacks, self.profile_to, stem, sampler.interval_s)
                log.info("start-up: %s's profile in %s", name, path)
            except OSError as exc:  # a diagnostic: the start goes on without it
                log.warning("start-up: %s's profile not written (%s)", name, exc)

    def queue(self, name: str) -> None:
        """Announce a phase that runs later (a background job queued at load): pending from now on, so
        between two jobs, or before the first starts, /ready never reads as if nothing were left."""
        with self._lock:
            self._queued.append(name)

    def record(self, name: str, start_s: float, seconds: float, background: bool = False) -> Phase:
        done = Phase(name, start_s, seconds, background)
        with self._lock:
            self._phases.append(done)
        log.info("start-up: %s took %.1f s (%.1f s since launch)", name, seconds, start_s + seconds)
        return done

    def mark_ready(self) -> None:
        """The server serves from now on (first call only: a later warm-up does not move it)."""
        with self._lock:
            if self._ready_s is None:
                self._ready_s = self.now_s()
                log.info("start-up: ready %.1f s after launch", self._ready_s)

    @property
    def phases(self) -> list[Phase]:
        with self._lock:
            return list(self._phases)

    @property
    def ready_s(self) -> float | None:
        return self._ready_s

    def pending(self) -> list[str]:
        """Phases that have started and not ended (background captures after ready, typically), then
        those queued to run."""
        with self._lock:
            return [*self._running.values(), *self._queued]

    def stage(self) -> str:
        """The stage: "warming" while start-up work is left (the LM handover, background graphs, the studio's
        build): the first requests may be slower; "steady" once none is."""
        return "warming" if self.pending() else "steady"

    def as_dict(self) -> dict[str, object]:
        """The JSON ``/ready`` returns: ready_s, now_s, phases (name, start_s, seconds, background),
        pending."""
        ready = self._ready_s
        return {
            "ready_s": None if ready is None else round(ready, 3),
            "now_s": round(self.now_s(), 3),
            "phases": [_rounded(asdict(p)) for p in self.phases],
            "pending": self.pending(),
        }


def _rounded(phase: dict[str, object]) -> dict[str, object]:
    """A phase for JSON: seconds to the millisecond."""
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in phase.items()}
