"""The open-loop soak (``python -m bench.soak --arrivals poisson``): requests arrive as a Poisson process at a
fixed rate for a fixed time, whatever the engine is doing, mixed as ``bench.soak_mix`` draws them (good
streams, streams in a saved voice, clients that leave mid-stream, bad requests). Memory is sampled as the
closed soak samples it (``bench.memory.sample``); a few voices are saved before and checked after.

The run passes (``violations`` is empty) when no good request failed (a refusal by admission is counted
apart), no admitted stream underran, every bad request got its case's error, every leaver's stream was
freed (the engine no longer holds it and counted it cancelled), nothing is left running or queued at the
end, the saved voices are listed and unchanged, and host and device memory are flat (``memory_trend``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.load import SAMPLE_RATE, TRANSCRIPT, distribution, percentile, prompt_audio
from bench.memory import Sample, Sampling, memory_trend, sample, sampler
from bench.soak_mix import BAD, BAD_CASES, LEAVER, Arrival, Client, MixConfig, Outcome, schedule, send
from engine.errors import InvalidInput
from engine.request import Mode


@dataclass(frozen=True)
class OpenSoakConfig:
    """The load (``mix``) and how the run is watched: ``slots`` streams compute at once (the capacity
    search's ``--concurrency``), ``voices`` saved at the start, TTFA reported per ``window_s``, memory read
    every ``sample_s``; a request still running ``drain_s`` after the last arrival counts as stuck; the run so
    far is handed to a checkpoint every ``checkpoint_s``."""

    mix: MixConfig
    slots: int = 96
    voices: int = 3
    window_s: float = 300.0
    sample_s: float = 10.0
    drain_s: float = 120.0
    trim: bool = False
    checkpoint_s: float = 60.0

    def __post_init__(self) -> None:
        if self.slots < 1 or self.voices < 1:
            raise ValueError(f"slots and voices must be >= 1, got {self.slots}, {self.voices}")
        if min(self.window_s, self.sample_s, self.drain_s, self.checkpoint_s) <= 0:
            raise ValueError("window_s, sample_s, drain_s and checkpoint_s must be > 0")


@dataclass(frozen=True)
class VoiceCheck:
    """Of the voices saved at the start: how many the store still lists, and how many read back unchanged
    (name, transcript, family and feature arrays hash the same)."""

    saved: int
    listed: int
    intact: int

    @property
    def ok(self) -> bool:
        return self.saved == self.listed == self.intact > 0


@dataclass
class OpenSoakRun:
    config: OpenSoakConfig
    samples: list[Sample] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    duration_s: float = 0.0
    stuck: int = 0  # requests still running ``drain_s`` after the last arrival (then cancelled)
    cancelled: int = 0  # streams the engine counted cancelled during the run (the leavers that left)
    voices: VoiceCheck | None = None


# ----------------------------------------------------------------------------------------------- voices


def fingerprint(engine: Any, voice_id: str, owner: str) -> str:
    """sha256 of what a saved voice is: its metadata and feature arrays as the store reads them back."""
    voice, features = engine.voices.get(voice_id, owner)
    digest = hashlib.sha256("\n".join((voice.name, voice.prompt_text, voice.family)).encode())
    for array in (features.speech_tokens, features.speaker_embedding, features.prompt_mel):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def save_voices(engine: Any, count: int, owner: str) -> dict[str, str]:
    """Save ``count`` voices (stand-in prompts of different pitch) for ``owner``: {id: fingerprint}."""
    ids = [
        engine.add_voice(
            f"soak voice {i}", (prompt_audio(f0=110.0 + 15.0 * i), SAMPLE_RATE), TRANSCRIPT, owner
        )
        for i in range(count)
    ]
    return {v.id: fingerprint(engine, v.id, owner) for v in ids}


def check_voices(engine: Any, saved: dict[str, str], owner: str) -> VoiceCheck:
    listed = {v.id for v in engine.list_voices(owner)} & set(saved)
    intact = 0
    for voice_id in listed:
        try:
            intact += fingerprint(engine, voice_id, owner) == saved[voice_id]
        except InvalidInput:  # NotFound for a damaged entry: listed but not intact
            continue
    return VoiceCheck(len(saved), len(listed), intact)


def remove_voices(engine: Any, saved: Iterable[str], owner: str) -> None:
    for voice_id in saved:
        engine.delete_voice(voice_id, owner)


# ------------------------------------------------------------------------------------------------- run


async def dispatch(
    client: Client, arrivals: Sequence[Arrival], outcomes: list[Outcome]
) -> set[asyncio.Task[None]]:
    """Start each request at its arrival time; returns the requests still running after the last one.
    Only running requests are held (not the whole schedule's coroutines), so the bench's own memory
    grows with the outcomes alone."""
    running: set[asyncio.Task[None]] = set()

    async def one(arrival: Arrival) -> None:
        outcomes.append(await send(client, arrival))

    for arrival in arrivals:
        await asyncio.sleep(max(0.0, client.t0 + arrival.at_s - time.monotonic()))  # the schedule
        task = asyncio.create_task(one(arrival))
        running.add(task)
        task.add_done_callback(running.discard)
    return running


async def drain(running: set[asyncio.Task[None]], ceiling_s: float) -> int:
    """Wait for the requests still running, at most ``ceiling_s``; cancel the rest: how many were stuck."""
    if not running:
        return 0
    _, pending = await asyncio.wait(set(running), timeout=ceiling_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


def status(run: OpenSoakRun) -> str:
    outs = run.outcomes
    failed = sum(o.kind != BAD and o.error is not None and not o.refused for o in outs)
    return f"requests {len(outs)} done, {failed} good failed, {sum(o.underruns > 0 for o in outs)} underran"


async def checkpoints(
    run: OpenSoakRun, t0: float, every_s: float, stop: asyncio.Event, save: Callable[[OpenSoakRun], None]
) -> None:
    """``save(run)`` every ``every_s`` until ``stop``, ``duration_s`` set to the time so far: a run cut
    short (a GPU machine's hold ending) still leaves what it measured."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if not stop.is_set():
            run.duration_s = time.monotonic() - t0
            save(run)


async def open_soak(
    engine: Any, cfg: OpenSoakConfig, checkpoint: Callable[[OpenSoakRun], None] | None = None
) -> OpenSoakRun:
    """Run the open-loop mix; the engine must be loaded and warm (``engine.warmup()``). ``checkpoint``,
    where given, gets the run so far every ``cfg.checkpoint_s``."""
    owner = f"soak-{uuid.uuid4().hex[:12]}"  # a fresh namespace: a rerun's voice names never clash
    saved = save_voices(engine, cfg.voices, owner)
    run, t0, cancelled = OpenSoakRun(cfg), time.monotonic(), engine.stats().cancelled
    client = Client(engine, prompt_audio(), tuple(saved), owner, t0, cfg.mix.mode)
    stop = asyncio.Event()
    every = Sampling(t0, cfg.sample_s, cfg.trim)
    watch = [asyncio.create_task(sampler(engine, run.samples, every, stop, lambda: status(run)))]
    if checkpoint is not None:
        watch.append(asyncio.create_task(checkpoints(run, t0, cfg.checkpoint_s, stop, checkpoint)))
    try:
        running = await dispatch(client, schedule(cfg.mix), run.outcomes)
        run.stuck = await drain(running, cfg.drain_s)
    finally:
        stop.set()
        await asyncio.gather(*watch)
    run.samples.append(sample(engine, t0, cfg.trim))  # the end state, once every request has ended
    run.cancelled = engine.stats().cancelled - cancelled
    run.voices = check_voices(engine, saved, owner)
    remove_voices(engine, saved, owner)
    run.duration_s = time.monotonic() - t0
    return run


# --------------------------------------------------------------------------------------------- summary


def ttfa_windows(outcomes: Sequence[Outcome], window_s: float, duration_s: float) -> list[dict[str, Any]]:
    """TTFA p50/p95 (ms) and underrun streams of the admitted streams by when they were sent, per
    ``window_s`` over the ``duration_s`` of arrivals (longer when the Poisson schedule's last ones came
    later): drift shows as a rising row, a bad start as a first row of its own."""
    span = max([duration_s] + [o.start_s + 1e-6 for o in outcomes])
    rows = []
    for k in range(max(1, int(np.ceil(span / window_s)))):
        lo, hi = k * window_s, (k + 1) * window_s
        sent = [o for o in outcomes if lo <= o.start_s < hi]
        ttfa = [o.ttfa_ms for o in sent if o.ttfa_ms is not None]
        p50, p95, underrun = percentile(ttfa, 50), percentile(ttfa, 95), sum(o.underruns > 0 for o in sent)
        rows.append({"from_s": lo, "to_s": hi, "requests": len(ttfa), "p50": p50, "p95": p95,
                     "underrun": underrun})  # fmt: skip
    return rows


def bad_summary(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """Per bad case: how many were sent, refused with the expected error, refused by admission, and the
    distinct errors they got (the messages a client reads)."""
    out = {}
    for case in BAD_CASES:
        mine = [o for o in outcomes if o.case == case.name]
        expected, refused = sum(bool(o.as_expected) for o in mine), sum(o.refused for o in mine)
        out[case.name] = {
            "expected": case.expected.__name__, "sent": len(mine), "as_expected": expected,
            "refused": refused, "wrong": len(mine) - expected - refused,
            "errors": sorted({(o.error or "no error: it was served")[:200] for o in mine})[:3],
        }  # fmt: skip
    return out


def leaver_summary(outcomes: Sequence[Outcome], cancelled: int) -> dict[str, int]:
    left = [o for o in outcomes if o.freed is not None]
    freed = sum(bool(o.freed) for o in left)
    return {"sent": len(outcomes), "left": len(left), "freed": freed, "engine_cancelled": cancelled}


def summarize(run: OpenSoakRun) -> dict[str, Any]:
    outs = run.outcomes
    clients = [o for o in outs if o.kind != BAD]
    admitted = [o for o in clients if not o.refused]
    failed = [o for o in clients if o.error is not None and not o.refused]
    served = [o for o in admitted if o.error is None]
    ts = [s.t_s for s in run.samples]
    audio = sum(o.audio_s for o in served)
    return {
        "config": asdict(run.config), "duration_s": run.duration_s, "requests": len(outs),
        "kinds": dict(Counter(o.kind for o in outs)), "good_requests": len(clients),
        "admitted": len(admitted),
        "refused": len(clients) - len(admitted), "good_failed": len(failed),
        "good_errors": dict(Counter((o.error or "").split(":")[0] for o in failed)),
        "underrun_streams": sum(o.underruns > 0 for o in served), "stuck": run.stuck,
        "leavers": leaver_summary([o for o in outs if o.kind == LEAVER], run.cancelled),
        "bad": bad_summary([o for o in outs if o.kind == BAD]),
        "voices": None if run.voices is None else {**asdict(run.voices), "ok": run.voices.ok},
        "ttfa_ms": distribution([o.ttfa_ms for o in served if o.ttfa_ms is not None]),
        "ttfa_windows": ttfa_windows(served, run.config.window_s, run.config.mix.minutes * 60.0),
        "audio_s_per_s": audio / run.duration_s if run.duration_s > 0 else None,
        "rss_mb": memory_trend(ts, [s.rss_mb for s in run.samples], run.duration_s),
        "py_blocks": memory_trend(ts, [float(s.py_blocks) for s in run.samples], run.duration_s),
        "device_mb": memory_trend(ts, [s.device_mb for s in run.samples], run.duration_s),
        "device_peak_mb": max((s.device_peak_mb for s in run.samples), default=0.0),
        "end_state": asdict(run.samples[-1]) if run.samples else None,
    }  # fmt: skip


def violations(summary: dict[str, Any]) -> list[str]:
    """Why the soak fails (empty: it passes)."""
    why = [f"{summary['good_failed']} good requests failed"] if summary["good_failed"] else []
    why += [f"{summary['underrun_streams']} admitted streams underran"] if summary["underrun_streams"] else []
    why += [] if summary["admitted"] else ["no request was admitted"]
    why += [
        f"bad '{k}': {v['wrong']} not refused with {v['expected']}"
        for k, v in summary["bad"].items()
        if v["wrong"]
    ]
    lv = summary["leavers"]
    if not lv["freed"] == lv["left"] == lv["engine_cancelled"]:
        why.append(
            f"leavers: {lv['left']} left, {lv['freed']} freed, the engine cancelled {lv['engine_cancelled']}"
        )
    end = summary["end_state"] or {}
    if summary["stuck"] or end.get("active") or end.get("queued"):
        why.append(
            f"{summary['stuck']} stuck; at the end {end.get('active')} active, {end.get('queued')} queued"
        )
    voices = summary["voices"]
    why += [] if voices and voices["ok"] else [f"voices store not intact: {voices}"]
    why += [f"{k} not flat" for k in ("rss_mb", "device_mb") if summary[k]["flat"] is False]
    return why


# ---------------------------------------------------------------------------------------------- report


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(summary: dict[str, Any], device: str, model: str) -> str:
    mix, why = summary["config"]["mix"], violations(summary)
    lines = [
        f"# Open-loop soak: {mix['rate']:g} requests/s for {mix['minutes']:g} min",
        "",
        f"Model `{model}` on `{device}`; {mix['tokens']} speech tokens +-{mix['spread']:.0%} per request, "
        f"{mix['leave_fraction']:.0%} leavers, {mix['bad_fraction']:.0%} bad requests, "
        f"{mix['voice_fraction']:.0%} of the good ones in a saved voice; "
        f"{summary['config']['slots']} engine slots. "
        f"Result: **{'PASS' if not why else 'FAIL'}**" + ("." if not why else ": " + "; ".join(why) + "."),
        "",
        *_totals(summary), "", *_windows(summary), "", *_bad(summary), "", *_memory(summary),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _totals(s: dict[str, Any]) -> list[str]:
    lv, v, t = s["leavers"], s["voices"] or {}, s["ttfa_ms"]
    return [
        "| requests | good | admitted | refused | good failed | underrun streams | leavers left / freed / "
        "cancelled | stuck | voices saved / listed / intact | TTFA p50 / p95 ms | audio s per s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['requests']} | {s['good_requests']} | {s['admitted']} | {s['refused']} | {s['good_failed']} "
        f"| {s['underrun_streams']} | {lv['left']} / {lv['freed']} / {lv['engine_cancelled']} | {s['stuck']} "
        f"| {v.get('saved')} / {v.get('listed')} / {v.get('intact')} | {_num(t['p50'])} / {_num(t['p95'])} "
        f"| {_num(s['audio_s_per_s'], '.1f')} |",
    ] + ([f"\nGood requests' errors: {s['good_errors']}"] if s["good_errors"] else [])


def _windows(s: dict[str, Any]) -> list[str]:
    rows = [
        "| sent at (min) | admitted streams | TTFA p50 ms | TTFA p95 ms | underrun streams |",
        "|---|---|---|---|---|",
    ]
    for w in s["ttfa_windows"]:
        span = f"{w['from_s'] / 60:g}-{w['to_s'] / 60:g}"
        under = w.get("underrun", "-")  # a soak.json written before the column: rescored without it
        rows.append(f"| {span} | {w['requests']} | {_num(w['p50'])} | {_num(w['p95'])} | {under} |")
    return rows


def _bad(s: dict[str, Any]) -> list[str]:
    rows = [
        "| bad request | sent | expected error | as expected | refused (busy) | errors |",
        "|---|---|---|---|---|---|",
    ]
    for name, b in s["bad"].items():
        errors = "; ".join(e.replace("|", "/") for e in b["errors"]) or "-"
        rows.append(
            f"| {name} | {b['sent']} | {b['expected']} | {b['as_expected']} | {b['refused']} | {errors} |"
        )
    return rows


def _memory(s: dict[str, Any]) -> list[str]:
    trim = s["config"]["trim"]
    rows = [
        "| memory (MiB) | first | min | max | last | late slope /min (Theil-Sen) | flat |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("rss_mb", "process RSS" + (" (after malloc_trim)" if trim else "")),
        ("device_mb", "device (torch)"),
    ):
        m = s[key]
        if m.get("flat") is not None:
            rows.append(
                f"| {label} | {_num(m['first'])} | {_num(m['min'])} | {_num(m['max'])} | {_num(m['last'])} "
                f"| {_num(m['late_slope_mb_per_min'], '.2f')} | {m['flat']} |"
            )
    return [*rows, "", f"Device peak (torch): {s['device_peak_mb']:.0f} MiB."]


def report_data(run: OpenSoakRun, summary: dict[str, Any], device: str, model: str) -> dict[str, Any]:
    """What ``soak.json`` holds: the summary, every memory sample and every request's outcome."""
    return {
        "summary": summary, "device": device, "model": model, "stuck": run.stuck, "cancelled": run.cancelled,
        "voices": None if run.voices is None else asdict(run.voices),
        "samples": [asdict(s) for s in run.samples], "outcomes": [asdict(o) for o in run.outcomes],
    }  # fmt: skip


def write_report(run: OpenSoakRun, out: Path, device: str, model: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    data = report_data(run, summary, device, model)
    (out / "soak.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "soak.md").write_text(markdown(summary, device, model))
    return summary


def write_partial(run: OpenSoakRun, out: Path, device: str, model: str) -> None:
    """The run so far as ``soak.partial.json`` (the same layout as ``soak.json``, ``summary.partial``
    true; its voices are not checked yet): what a soak cut short leaves. Written to a temporary name and
    renamed, so a reader never meets half a file."""
    out.mkdir(parents=True, exist_ok=True)
    data = report_data(run, {**summarize(run), "partial": True}, device, model)
    tmp = out / "soak.partial.json.tmp"
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(out / "soak.partial.json")


def read_report(data: dict[str, Any]) -> tuple[OpenSoakRun, str, str]:
    """A written open-loop ``soak.json`` (parsed) back into its run, device and model."""
    cfg = dict(data["summary"]["config"])
    cfg["mix"] = MixConfig(**{**cfg["mix"], "mode": Mode(cfg["mix"]["mode"])})
    run = OpenSoakRun(
        config=OpenSoakConfig(**cfg),
        samples=[Sample(**s) for s in data["samples"]],
        outcomes=[Outcome(**o) for o in data["outcomes"]],
        duration_s=data["summary"]["duration_s"],
        stuck=data["stuck"],
        cancelled=data["cancelled"],
        voices=None if data["voices"] is None else VoiceCheck(**data["voices"]),
    )
    return run, data["device"], data["model"]
