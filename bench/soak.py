"""Soak: a steady load through one in-process ``TTSEngine`` for a fixed time, with process RSS and device
memory sampled at a fixed interval; the question is whether memory stays flat and requests keep succeeding
over a long run.

python -m bench.soak --model DIR --streams 32 --minutes 30 --out DIR
python -m bench.soak --model DIR --arrivals poisson --rate 4 --minutes 25 --out DIR

Closed loop (the default): every stream sends its next fixed-length request (``forced_tokens``, one fixed
text, the stand-in prompt of ``bench.load``) as soon as the previous one ends; no new request starts after
``--minutes``. Open loop (``--arrivals poisson``, ``bench.soak_open``): requests arrive at ``--rate`` per
second with lengths of ``--tokens`` +- ``--spread``, ``--leave-fraction`` of the clients leave mid-stream,
``--bad-fraction`` are bad requests that must get their documented error, and saved voices are checked at
the end. Writes ``soak.json`` (summary + every memory sample + every request) and ``soak.md`` to ``--out``.
Exit status 1 when the run fails: a request failed or memory was not flat (see ``memory_trend``), and in
the open loop any of ``bench.soak_open.violations``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.load import Workload, distribution, prompt_audio
from bench.memory import Sample, Sampling, memory_trend, sample, sampler
from engine.config import add_device_flags, add_model_flag
from engine.request import Mode

log = logging.getLogger("bench.soak")


@dataclass(frozen=True)
class SoakConfig:
    streams: int = 32
    minutes: float = 30.0
    tokens: int = 250  # speech tokens per request = 10 s of audio
    sample_s: float = 10.0  # memory sampling interval
    mode: Mode = Mode.ZERO_SHOT  # the prompt's speech tokens in the LM prefix, as voice cloning runs
    trim: bool = False  # malloc_trim before each RSS reading (leak vs. allocator page caching)

    def __post_init__(self) -> None:
        if self.streams < 1 or self.tokens < 1:
            raise ValueError(f"streams and tokens must be >= 1, got {self.streams}, {self.tokens}")
        if self.minutes <= 0 or self.sample_s <= 0:
            raise ValueError(f"minutes and sample_s must be > 0, got {self.minutes}, {self.sample_s}")


@dataclass(frozen=True)
class Request:
    """One request as its stream saw it; ``ttfa_ms`` is submit -> first audio, ``error`` set on failure."""

    stream: int
    start_s: float
    elapsed_s: float
    audio_s: float
    ttfa_ms: float | None
    error: str | None = None


@dataclass
class SoakRun:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    duration_s: float = 0.0


# ------------------------------------------------------------------------------------------------- run


async def one_request(
    engine: Any, workload: Workload, seed: int, prompt: np.ndarray
) -> tuple[float, float | None]:
    """(audio seconds, client-side TTFA ms) of one streamed request; raises what the engine raised."""
    t0, ttfa, audio = time.perf_counter(), None, 0.0
    async for chunk in engine.stream(workload.request(seed, prompt)):
        if chunk.pcm.size and ttfa is None:
            ttfa = (time.perf_counter() - t0) * 1000.0
        audio += chunk.seconds
    return audio, ttfa


async def stream_worker(engine: Any, run: SoakRun, index: int, t0: float, deadline: float) -> None:
    workload = Workload(tokens=run.config.tokens, mode=run.config.mode)
    prompt = prompt_audio()
    seed = index * 1_000_000
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            audio, ttfa = await one_request(engine, workload, seed, prompt)
            error = None
        except Exception as err:  # a soak counts every failure and keeps the load on
            audio, ttfa, error = 0.0, None, f"{type(err).__name__}: {err}"
            log.warning("stream %d: request failed: %s", index, error)
        run.requests.append(Request(index, start - t0, time.monotonic() - start, audio, ttfa, error))
        seed += 1


def closed_status(run: SoakRun) -> str:
    done = sum(r.error is None for r in run.requests)
    return f"requests {done} ok / {len(run.requests) - done} failed"


async def soak(engine: Any, cfg: SoakConfig) -> SoakRun:
    """Run the steady load; the engine must be loaded and warm (``engine.warmup()``)."""
    run, t0 = SoakRun(cfg), time.monotonic()
    deadline, stop = t0 + cfg.minutes * 60.0, asyncio.Event()
    every = Sampling(t0, cfg.sample_s, cfg.trim)
    watch = asyncio.create_task(sampler(engine, run.samples, every, stop, lambda: closed_status(run)))
    await asyncio.gather(*(stream_worker(engine, run, i, t0, deadline) for i in range(cfg.streams)))
    stop.set()
    await watch
    run.samples.append(sample(engine, t0, cfg.trim))  # the end state, once every stream has finished
    run.duration_s = time.monotonic() - t0
    return run


# --------------------------------------------------------------------------------------------- summary


def summarize(run: SoakRun) -> dict[str, Any]:
    ok = [r for r in run.requests if r.error is None]
    audio_s = sum(r.audio_s for r in ok)
    ts = [s.t_s for s in run.samples]
    return {
        "config": asdict(run.config),
        "duration_s": run.duration_s,
        "requests": len(run.requests),
        "completed": len(ok),
        "errors": len(run.requests) - len(ok),
        "error_kinds": dict(Counter((r.error or "").split(":")[0] for r in run.requests if r.error)),
        "ttfa_ms": distribution([r.ttfa_ms for r in ok if r.ttfa_ms is not None]),
        "rtf": distribution([r.elapsed_s / r.audio_s for r in ok if r.audio_s > 0]),
        "audio_s_total": audio_s,
        "audio_s_per_s": audio_s / run.duration_s if run.duration_s > 0 else None,
        "rss_mb": memory_trend(ts, [s.rss_mb for s in run.samples], run.duration_s),
        "py_blocks": memory_trend(ts, [float(s.py_blocks) for s in run.samples], run.duration_s),
        "device_mb": memory_trend(ts, [s.device_mb for s in run.samples], run.duration_s),
        "device_peak_mb": max((s.device_peak_mb for s in run.samples), default=0.0),
        "end_state": asdict(run.samples[-1]) if run.samples else None,
    }


def passed(summary: dict[str, Any]) -> bool:
    flat = [summary[k]["flat"] for k in ("rss_mb", "device_mb")]
    return summary["errors"] == 0 and summary["completed"] > 0 and all(f is not False for f in flat)


def markdown(summary: dict[str, Any], device: str, model: str) -> str:
    cfg, ttfa, rtf = summary["config"], summary["ttfa_ms"], summary["rtf"]
    verdict = "PASS" if passed(summary) else "FAIL"

    def num(x: float | None, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"# Soak: {cfg['streams']} streams for {cfg['minutes']:g} min",
        "",
        f"Model `{model}` on `{device}`; {cfg['tokens']} speech tokens per request ({cfg['tokens'] / 25:g} s "
        f"of audio), memory sampled every {cfg['sample_s']:g} s. Result: **{verdict}**.",
        "",
        "| requests | completed | errors | TTFA p50 / p95 / max (ms) | RTF p50 / p95 | audio s per s |",
        "|---|---|---|---|---|---|",
        f"| {summary['requests']} | {summary['completed']} | {summary['errors']} "
        f"| {num(ttfa['p50'], '.0f')} / {num(ttfa['p95'], '.0f')} / {num(ttfa['max'], '.0f')} "
        f"| {num(rtf['p50'], '.3f')} / {num(rtf['p95'], '.3f')} | {num(summary['audio_s_per_s'], '.2f')} |",
        "",
        "| memory (MiB) | first | min | max | last | slope /min | late slope /min (Theil-Sen) | flat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rss = "process RSS (after malloc_trim)" if cfg["trim"] else "process RSS"
    for key, label in (("rss_mb", rss), ("device_mb", "device (torch)")):
        m = summary[key]
        if m.get("flat") is None:
            continue
        slopes = f"{num(m['slope_mb_per_min'], '.2f')} | {num(m['late_slope_mb_per_min'], '.2f')}"
        levels = f"{num(m['first'])} | {num(m['min'])} | {num(m['max'])} | {num(m['last'])}"
        lines.append(f"| {label} | {levels} | {slopes} | {m['flat']} |")
    blocks = summary["py_blocks"]
    lines += ["", f"Device peak (torch): {summary['device_peak_mb']:.0f} MiB."]
    if blocks.get("flat") is not None:
        lines.append(
            f"Python's allocated blocks: {blocks['first']:.0f} first, {blocks['last']:.0f} last, "
            f"late slope {num(blocks['late_slope_mb_per_min'], '.0f')} /min."
        )
    lines.append(
        "The verdict uses raw RSS and device memory; the trimmed RSS and Python's block count tell a leak "
        "(both grow) from allocator caching (only raw RSS grows)."
    )
    if summary["error_kinds"]:
        lines += ["", "Errors: " + ", ".join(f"{k} x{n}" for k, n in summary["error_kinds"].items())]
    return "\n".join(lines) + "\n"


def write_report(run: SoakRun, out: Path, device: str, model: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    data = {
        "summary": summary,
        "device": device,
        "model": model,
        "samples": [asdict(s) for s in run.samples],
        "requests": [asdict(r) for r in run.requests],
    }
    (out / "soak.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "soak.md").write_text(markdown(summary, device, model))
    return summary


def read_report(path: Path) -> tuple[SoakRun, str, str]:
    """A written ``soak.json`` back into its run, device and model (to score it again with this code)."""
    data = json.loads(path.read_text())
    cfg = dict(data["summary"]["config"])
    cfg["mode"] = Mode(cfg["mode"])
    run = SoakRun(
        config=SoakConfig(**cfg),
        samples=[Sample(**s) for s in data["samples"]],
        requests=[Request(**r) for r in data["requests"]],
        duration_s=data["summary"]["duration_s"],
    )
    return run, data["device"], data["model"]


# ------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    add_model_flag(p, None, "model directory (or hub id)")
    p.add_argument("--rescore", action="store_true", help="score --out's soak.json again; run nothing")
    p.add_argument("--streams", type=int, default=32, help="closed loop: streams sending back to back")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 = 1 s of audio)")
    p.add_argument("--sample-s", type=float, default=10.0, help="memory sampling interval")
    p.add_argument("--mode", default="zero_shot", choices=["zero_shot", "cross_lingual"])
    p.add_argument("--trim", action="store_true", help="malloc_trim before each RSS reading (glibc)")
    p.add_argument("--cache-dir", help="the engine's cache root (compile caches, saved voices)")
    p.add_argument(
        "--start-at-ready", action="store_true",
        help="send from ready on, the background graphs still being built (a start under load, and a soak "
        "that fits a shorter machine hold); memory is judged on the run's late half either way",
    )  # fmt: skip
    add_open_flags(p)
    add_device_flags(p)
    p.add_argument("--out", required=True, help="directory for soak.json and soak.md")
    args = p.parse_args(argv)
    if args.arrivals == "poisson" and args.rate is None:
        p.error("--arrivals poisson needs --rate (requests/s: the capacity the open-loop bench found)")
    return args


def add_open_flags(p: argparse.ArgumentParser) -> None:
    """The open-loop mode's flags (``bench.soak_open``)."""
    p.add_argument(
        "--arrivals", default="closed", choices=["closed", "poisson"],
        help="closed: --streams back to back; poisson: open loop at --rate with leavers and bad requests",
    )  # fmt: skip
    p.add_argument("--rate", type=float, help="open loop: arrivals per second")
    p.add_argument(
        "--spread", type=float, default=0.5, help="open loop: lengths within tokens x (1 +- spread)"
    )
    p.add_argument(
        "--leave-fraction", type=float, default=0.10, help="open loop: clients that leave mid-stream"
    )
    p.add_argument("--bad-fraction", type=float, default=0.05, help="open loop: bad requests")
    p.add_argument("--voice-fraction", type=float, default=0.05, help="open loop: good ones in a saved voice")
    p.add_argument(
        "--voices", type=int, default=3, help="open loop: voices saved at the start, checked at the end"
    )
    p.add_argument("--slots", type=int, default=96, help="open loop: the engine's streams computing at once")
    p.add_argument(
        "--window-s", type=float, default=300.0, help="open loop: TTFA percentiles per this window"
    )
    p.add_argument("--drain-s", type=float, default=120.0, help="open loop: wait after the last arrival")
    p.add_argument(
        "--checkpoint-s", type=float, default=60.0,
        help="open loop: write the run so far to soak.partial.json this often (s)",
    )  # fmt: skip
    p.add_argument("--admit-slack-s", type=float, help="open loop: admission by SLO (as python -m bench)")
    p.add_argument("--seed", type=int, default=0, help="open loop: the schedule's seed")


def open_config(args: argparse.Namespace) -> Any:
    from bench.soak_mix import MixConfig
    from bench.soak_open import OpenSoakConfig

    mix = MixConfig(
        args.rate, args.minutes, args.tokens, args.spread, args.leave_fraction, args.bad_fraction,
        args.voice_fraction, args.seed, Mode(args.mode),
    )  # fmt: skip
    return OpenSoakConfig(
        mix, args.slots, args.voices, args.window_s, args.sample_s, args.drain_s, args.trim, args.checkpoint_s
    )


def load_engine(args: argparse.Namespace, slots: int, longest_tokens: int) -> Any:
    """Every stream computes at once (``slots``); flow graphs cover the longest request after the prompt."""
    from bench.__main__ import MARGIN_S, PROMPT_S
    from engine.config import EngineConfig, Limits
    from engine.serving.engine import TTSEngine

    limits = Limits(max_concurrency=slots, max_queue=slots, admit_slack_s=args.admit_slack_s)
    warmup = max(EngineConfig.graph_warmup_s, longest_tokens / 25.0 + PROMPT_S + MARGIN_S)
    cfg = EngineConfig(
        model=args.model,
        device=args.device,
        backend=args.backend,
        cache_dir=args.cache_dir,
        limits=limits,
        graph_warmup_s=warmup,
        lm_handover=False,  # the soak's load on vLLM from its first request (not the native loop beside it)
    )
    return TTSEngine.load(cfg)


def log_full_speed(builder: Any) -> threading.Thread:
    """Log when the engine's background work (graphs, compile) is done, the soak already running."""
    t0 = time.monotonic()
    log.info("the soak starts at ready; background work still to run: %d job(s)", builder.pending)

    def wait() -> None:
        builder.wait()
        log.info("full speed: the background work ended %.0f s into the soak", time.monotonic() - t0)

    thread = threading.Thread(target=wait, name="soak-full-speed", daemon=True)
    thread.start()
    return thread


async def run_cli(args: argparse.Namespace) -> dict[str, Any]:
    opened = open_config(args) if args.arrivals == "poisson" else None
    cfg = SoakConfig(args.streams, args.minutes, args.tokens, args.sample_s, Mode(args.mode), args.trim)
    slots = opened.slots if opened else cfg.streams
    engine = load_engine(args, slots, round(args.tokens * (1 + (args.spread if opened else 0.0))))
    try:
        await engine.warmup()
        if args.start_at_ready:
            log_full_speed(engine.graph_builder)
        else:
            await asyncio.to_thread(engine.graph_builder.wait)  # the soak measures the finished engine
        device, out = str(engine.model.device), Path(args.out)
        if opened is None:
            return write_report(await soak(engine, cfg), out, device, str(args.model))
        from bench import soak_open

        def checkpoint(run: Any) -> None:
            soak_open.write_partial(run, out, device, str(args.model))

        opened_run = await soak_open.open_soak(engine, opened, checkpoint)
        return soak_open.write_report(opened_run, out, device, str(args.model))
    finally:
        engine.close()


def rescore(out: Path) -> dict[str, Any]:
    """Score ``out/soak.json`` again with this code (either mode), rewriting it and soak.md."""
    data = json.loads((out / "soak.json").read_text())
    if "mix" in data["summary"]["config"]:
        from bench import soak_open

        opened, device, model = soak_open.read_report(data)
        return soak_open.write_report(opened, out, device, model)
    run, device, model = read_report(out / "soak.json")
    return write_report(run, out, device, model)


def verdict(summary: dict[str, Any]) -> list[str]:
    """Why the run failed, either mode (empty: it passed)."""
    if "mix" in summary["config"]:
        from bench import soak_open

        return soak_open.violations(summary)
    return [] if passed(summary) else [f"{summary['errors']} errors or memory not flat"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.rescore:
        summary = rescore(Path(args.out))
    elif args.model is None:
        raise SystemExit("python -m bench.soak: --model is required (unless --rescore)")
    else:
        summary = asyncio.run(run_cli(args))
    why = verdict(summary)
    log.info(
        "%d requests, TTFA p50 %s ms, RSS flat %s, device flat %s: %s; report in %s",
        summary["requests"], summary["ttfa_ms"]["p50"], summary["rss_mb"]["flat"],
        summary["device_mb"]["flat"], "; ".join(why) or "PASS", args.out,
    )  # fmt: skip
    return 0 if not why else 1


if __name__ == "__main__":
    sys.exit(main())
