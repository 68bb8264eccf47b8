"""A long run's memory: process RSS, device memory and the blocks Python's allocator holds, sampled at a fixed
interval beside the load (``sampler``), and the verdict on whether they stayed flat (``memory_trend``).
Both soaks use it: the closed one (``bench.soak``) and the open one (``bench.soak_open``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# the soak's logger: run.sh soak-start waits for its first "bench.soak: t=" line (the first sample)
log = logging.getLogger("bench.soak")

# Memory counts as flat when the trend of the second half of the run, extended over the whole run, adds
# less than this (MiB) or this fraction of the starting level, whichever is larger.
FLAT_MB, FLAT_FRACTION = 64.0, 0.02


@dataclass(frozen=True)
class Sample:
    """One memory reading: seconds since the start, MiB, and the engine's gauges at that moment."""

    t_s: float
    rss_mb: float
    device_mb: float
    device_peak_mb: float
    active: int
    queued: int
    completed: int
    failed: int
    py_blocks: int  # memory blocks Python's allocator holds (python_blocks): growth is a Python-level leak


@dataclass(frozen=True)
class Sampling:
    """When the run started (``time.monotonic``), how often memory is read (s), and whether RSS is read
    after ``malloc_trim``."""

    t0: float
    interval_s: float
    trim: bool = False


def rss_mb() -> float:
    """Resident set size of this process now, in MiB (Linux /proc; peak RSS where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def release_free_heap() -> None:
    """glibc ``malloc_trim``: give free heap pages back to the OS, so RSS counts what is still held.
    Raw RSS also counts freed pages the allocator keeps, which grow in steps without any leak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        log.debug("no glibc: RSS is read untrimmed")


def python_blocks() -> int:
    """Memory blocks Python's allocator holds now (``sys.getallocatedblocks``): what a Python-level leak
    grows. Read without touching any object: ``len(gc.get_objects())``, read here before, held a reference
    to every tracked object for a moment, and a tuple another thread was still building from a generator
    (the flow's ``tuple(...)`` on the token2wav worker) then failed its resize with SystemError, failing
    that request (seen in CI, 2026-12-07)."""
    return sys.getallocatedblocks()


def sample(engine: Any, t0: float, trim: bool = False) -> Sample:
    from engine import device as devices

    stats, dev = engine.stats(), engine.model.device
    if trim:
        release_free_heap()
    return Sample(
        t_s=time.monotonic() - t0,
        py_blocks=python_blocks(),
        rss_mb=rss_mb(),
        device_mb=devices.memory_mb(dev),
        device_peak_mb=devices.peak_memory_mb(dev),
        active=stats.active_streams,
        queued=stats.queued,
        completed=stats.completed,
        failed=stats.failed,
    )


async def sampler(
    engine: Any, samples: list[Sample], every: Sampling, stop: asyncio.Event, status: Callable[[], str]
) -> None:
    """Sample memory every ``every.interval_s`` until ``stop``; each line also logs ``status()``."""
    while not stop.is_set():
        s = sample(engine, every.t0, every.trim)
        samples.append(s)
        log.info(
            "t=%5.0f s  %s  RSS %.0f MiB  device %.0f MiB (peak %.0f)  active %d  Python blocks %d",
            s.t_s, status(), s.rss_mb, s.device_mb, s.device_peak_mb, s.active, s.py_blocks,
        )  # fmt: skip
        with contextlib.suppress(TimeoutError):  # the interval passed: sample again
            await asyncio.wait_for(stop.wait(), every.interval_s)


def slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys over ts (seconds), in units per minute; None with fewer than 2 points."""
    if len(ts) < 2 or max(ts) == min(ts):
        return None
    return float(np.polyfit(np.asarray(ts, float), np.asarray(ys, float), 1)[0] * 60.0)


def robust_slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Theil-Sen slope (the median of the slopes between every two samples), per minute: one transient
    spike, e.g. many requests' buffers alive at one sample, cannot tilt it as it tilts least squares (the
    H200 soak of 2026-11-30: device memory ~3.77 GiB throughout, one 4.57 GiB sample late on made the
    least-squares late slope 3.7 MiB/min)."""
    t, y = np.asarray(ts, float), np.asarray(ys, float)
    i, j = np.triu_indices(t.size, k=1)
    dt = t[j] - t[i]
    keep = dt > 0
    return float(np.median((y[j] - y[i])[keep] / dt[keep]) * 60.0) if keep.any() else None


def memory_trend(ts: Sequence[float], ys: Sequence[float], duration_s: float) -> dict[str, Any]:
    """min/max/first/last, the least-squares slope over the whole run, the robust slope over its second
    half (after warm-up effects), and ``flat``: that late slope extended over the run adds less than
    max(FLAT_MB, FLAT_FRACTION x first)."""
    if not ys:
        return {"flat": None}
    late = [i for i, t in enumerate(ts) if t >= ts[-1] / 2]
    late_slope = robust_slope_per_min([ts[i] for i in late], [ys[i] for i in late])
    projected = abs(late_slope or 0.0) * duration_s / 60.0
    return {
        "first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys),
        "slope_mb_per_min": slope_per_min(ts, ys), "late_slope_mb_per_min": late_slope,
        "projected_growth_mb": projected, "flat": bool(projected < max(FLAT_MB, FLAT_FRACTION * ys[0])),
    }  # fmt: skip
