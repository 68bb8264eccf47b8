"""A torch.profiler pass over one untimed bench level: where each stream's time goes, by operator.

``python -m bench ... --profile-dir DIR`` runs, after the timed sweep, one more level per streaming
concurrency under the profiler and writes ``profile_c{N}.md``: the labelled stages (``t2w.flow``,
``t2w.flow.solver``, ``t2w.hift``, ``t2w.hift.batch``) and the top operators by device and by host time.
The speech LM runs in vLLM's engine-core process, so on that backend its kernels are not in this trace
(its share is the request's LM stage time in the timed results). Profiling slows the run: the timed
numbers never come from a profiled level.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.load import Level, Target, Workload, run_level

log = logging.getLogger(__name__)
STAGES = ("t2w.flow", "t2w.flow.solver", "t2w.hift", "t2w.hift.batch")


def activities() -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def all_threads() -> Any:
    """Record every thread's operators: flow and HiFT run on the token2wav worker, not the event loop."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: the worker's operators are missing from the summary
        log.warning("this torch cannot profile all threads; only the event loop thread is recorded")
        return None


async def profile_level(
    target: Target, workload: Workload, concurrency: int, prompt: np.ndarray, out_dir: Path
) -> Path:
    """One wave of ``concurrency`` requests under the profiler -> the markdown summary's path."""
    with profile(activities=activities(), experimental_config=all_threads()) as prof:
        level = await run_level(target, workload, concurrency, concurrency, prompt, seed=10**7)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"profile_c{concurrency}.md"
    path.write_text(summary(prof, level))
    log.info("profile of %d streams: %s", concurrency, path)
    return path


def summary(prof: profile, level: Level) -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    events = prof.key_averages()
    lines = [
        f"# Profile: {level.concurrency} streams, {level.requests} requests, {level.mode}",
        "",
        f"wall {level.wall_s:.2f} s, audio {level.audio_s_per_s * level.wall_s:.1f} s; stage ms per request "
        f"(mean): {level.stage_ms_mean}",
        "",
        "## Labelled stages (host ms = wall time spent inside the label on the token2wav thread)",
        "",
        "| stage | calls | host ms | device ms |",
        "|---|---|---|---|",
    ]
    for e in events:
        if e.key in STAGES:
            lines.append(
                f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.1f} | {_device_us(e) / 1e3:.1f} |"
            )
    lines += ["", "Each call's host ms, in the order they started (an outlier shows which chunk pays):", ""]
    lines += [f"- {name}: {calls}" for name, calls in per_call_ms(prof).items()]
    tables = [("self host time", _self_cpu_us)]
    if device == "cuda":
        tables.insert(0, ("self device time", _self_device_us))
    for title, key in tables:
        lines += [
            "",
            f"## Top operators by {title}",
            "",
            "| operator | calls | self device ms | self host ms |",
        ]
        lines.append("|---|---|---|---|")
        for e in sorted(events, key=key, reverse=True)[:25]:
            lines.append(
                f"| {e.key[:80]} | {e.count} | {_self_device_us(e) / 1e3:.1f} | {_self_cpu_us(e) / 1e3:.1f} |"
            )
    return "\n".join(lines) + "\n"


def per_call_ms(prof: profile, first: int = 40) -> dict[str, str]:
    """The labelled stages' calls one by one (host ms, start order; the first ``first`` of each)."""
    calls: dict[str, list[tuple[float, float]]] = {}
    for e in prof.events():
        if e.name in STAGES:
            calls.setdefault(e.name, []).append((e.time_range.start, e.time_range.elapsed_us() / 1e3))
    return {
        name: ", ".join(f"{ms:.1f}" for _, ms in sorted(rows)[:first]) for name, rows in sorted(calls.items())
    }


def _device_us(e) -> float:
    return float(getattr(e, "device_time_total", 0.0) or 0.0)


def _self_device_us(e) -> float:
    return float(getattr(e, "self_device_time_total", 0.0) or 0.0)


def _self_cpu_us(e) -> float:
    return float(e.self_cpu_time_total)
