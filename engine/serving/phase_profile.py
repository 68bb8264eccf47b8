"""Where a start-up phase's time goes: one thread's Python stack sampled at an interval while the phase runs
(``--profile-startup DIR``), written as collapsed stacks and a summary of the hottest functions.

Why sampling and not cProfile: from Python 3.12 cProfile rides on ``sys.monitoring``, which watches every
thread at once and allows one profiler a process, while start-up phases run on several threads at once (the
weights beside the LM backend's start, graph captures behind serving requests). A sampler reads one thread's
frames (``sys._current_frames``) and costs the phase only the GIL hand-overs of one sample every 10 ms.

A thread waiting for the GIL or blocked in C (a CUDA copy, a file read, a lock) is sampled at the Python line
that called it: the time is charged where it was spent waiting, which is what a start-up is made of.
Stdlib only, like the timeline.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType

log = logging.getLogger(__name__)
Names = dict[tuple[CodeType, int], str]  # (code, line) -> "function (file:line)"
INTERVAL_S = 0.01  # a sample every 10 ms: ~100 a second, a phase of 1 s has a usable profile
MAX_DEPTH = 120  # frames kept per sample, from the outermost (deeper frames are rare and add no insight)
TOP = 40  # functions in the summary, by inclusive samples and by own samples


class PhaseProfile:
    """Samples ``thread_id``'s stack from ``start()`` until ``stop()`` on a daemon thread of its own."""

    def __init__(self, thread_id: int, interval_s: float = INTERVAL_S):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.thread_id, self.interval_s = thread_id, interval_s
        self.stacks: Counter[tuple[str, ...]] = Counter()  # outermost first -> samples
        self._names: Names = {}  # stack_of's cache
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._run, name="phase-profile", daemon=True)

    def start(self) -> None:
        self._sampler.start()

    def stop(self) -> Counter[tuple[str, ...]]:
        """End the sampling (the sampler finishes its current sample) -> the stacks sampled."""
        self._done.set()
        self._sampler.join()
        return self.stacks

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:  # the thread has ended
                return
            self.stacks[stack_of(frame, self._names)] += 1


def stack_of(frame: FrameType | None, names: Names | None = None) -> tuple[str, ...]:
    """The frames from the outermost to ``frame`` as ``function (file:line)`` names; ``names`` caches them
    per line, so that a phase's samples share their strings (a cold compile's 30,000 samples of ~100
    frames would otherwise hold millions of them)."""
    names = {} if names is None else names
    stack: list[str] = []
    while frame is not None:
        where = (frame.f_code, frame.f_lineno)
        if (name := names.get(where)) is None:
            name = names[where] = f"{where[0].co_name} ({_short(where[0].co_filename)}:{where[1]})"
        stack.append(name)
        frame = frame.f_back
    return tuple(reversed(stack[-MAX_DEPTH:]))


def _short(path: str) -> str:
    """A source path from its package down (.../site-packages/torch/x.py -> torch/x.py), else its last three
    parts."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return "/".join(path.split("/")[-3:])


def summary(stacks: Counter[tuple[str, ...]], interval_s: float, top: int = TOP) -> str:
    """The functions holding the most samples: inclusive (anywhere on the stack; a line counted once per
    sample however deep it recurses), then own (the innermost frame), each as seconds and a share."""
    total = sum(stacks.values())
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, n in stacks.items():
        for name in set(map(_function, stack)):
            inclusive[name] += n
        if stack:
            own[stack[-1]] += n
    lines = [f"{total} samples, {total * interval_s:.1f} s"]
    for title, counts in (("inclusive", inclusive), ("own (innermost line)", own)):
        lines.append(f"\n{title}:")
        lines += [
            f"{n * interval_s:8.2f} s {100 * n / max(total, 1):5.1f} %  {name}"
            for name, n in counts.most_common(top)
        ]
    return "\n".join(lines) + "\n"


def _function(frame_name: str) -> str:
    """``name (file:line)`` -> ``name (file)``: inclusive time per function, whatever line it was on."""
    return re.sub(r":\d+\)$", ")", frame_name)


def write(stacks: Counter[tuple[str, ...]], folder: Path, stem: str, interval_s: float) -> Path:
    """``folder/stem.folded`` (one ``a;b;c count`` line per stack: flame graph tools read it) and
    ``folder/stem.txt`` (``summary``) -> the summary's path."""
    folder.mkdir(parents=True, exist_ok=True)
    folded = "".join(f"{';'.join(s)} {n}\n" for s, n in stacks.most_common())
    (folder / f"{stem}.folded").write_text(folded)
    text = folder / f"{stem}.txt"
    text.write_text(summary(stacks, interval_s))
    return text


def file_stem(start_s: float, name: str) -> str:
    """A phase's files, in the order the phases began: ``0012.3-flow-compile``."""
    return f"{start_s:06.1f}-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
