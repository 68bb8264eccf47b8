"""``python -m bench.overlap``: the speech LM and the flow on one GPU, alone and together, in one engine load.

    python -m bench.overlap --random-full v3 --device cuda --backend vllm --concurrency 1,16 --tokens 250 \\
        --requests 8 --arm default --out bench-results/overlap_v3_default
    python -m bench.overlap --random-tiny v2 --concurrency 1,2 --tokens 30 --lm-levels 1,2 \\
        --flow-batches 1,2 --out /tmp/overlap          # CPU smoke run

Every bench flag applies (the engine is ``python -m bench``'s, ``--cuda-mps`` and ``--no-t2w-own-stream``
included). After the load and every background graph, it measures:

1. the LM alone: ``--lm-levels`` concurrent decodes of ``--tokens`` forced tokens straight on the LM
   backend (no flow work): tokens/s and the step time (ms per token of one decode);
2. the flow alone: flow + vocoder calls on ``--flow-batches`` rows of ``--flow-tokens`` tokens each (a
   whole utterance's final call, the longest kind), back to back;
3. both at once, per LM level and flow batch size: the LM timed while the flow runs back to back, then
   the flow's calls timed while the LM decodes that level round after round;
4. the usual end-to-end stream bench (``bench.__main__.sweep``) at ``--concurrency``: TTFA, RTF, stages;
5. with ``--profile-dir``: ``bench.profile``'s torch.profiler summary of one stream wave per level.

Writes OUT/results.json (after every phase, so a run cut short keeps what it measured) and OUT/results.md:
LM step ms alone vs with the flow, flow call ms alone vs with the LM, and the slowdowns (with / alone).
On vLLM the LM's step is timed from this process (the engine core's outputs as our event loop receives
them), which is what a request waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from bench import __main__ as bench
from bench.load import EngineTarget, Level, Workload, percentile, prompt_audio

log = logging.getLogger("bench.overlap")
T = TypeVar("T")


# ------------------------------------------------------------------------------------------ the numbers


@dataclass(frozen=True)
class Timing:
    """A distribution of times, ms."""

    n: int
    mean: float | None
    p50: float | None
    p95: float | None
    max: float | None

    @classmethod
    def of(cls, ms: Sequence[float]) -> Timing:
        if not ms:
            return cls(0, None, None, None, None)
        return cls(len(ms), float(np.mean(ms)), percentile(ms, 50), percentile(ms, 95), float(max(ms)))


@dataclass(frozen=True)
class LmRun:
    """``sessions`` decodes at once, ``rounds`` times: each decode's step (its time per token after its
    first token) and the gaps between tokens as they arrived (vLLM may hand over several at once: p95 and
    max show the stalls), the first token's latency, and tokens/s over the rounds' wall time."""

    sessions: int
    rounds: int
    tokens: int  # every decode's tokens together
    wall_s: float
    tokens_per_s: float
    step_ms: Timing  # one value per decode: (last - first token) / (tokens - 1)
    gap_ms: Timing
    first_token_ms: Timing


@dataclass(frozen=True)
class FlowRun:
    """Flow + vocoder calls of ``batch`` rows (the worker may cut a batch at its ``flow_batch``): each
    call's time from taking its rows to the last row's audio, and its flow and vocoder parts."""

    batch: int
    tokens: int  # speech tokens per row
    calls: int
    rows: float  # per call, mean: below ``batch`` where the worker took a batch before all its rows came
    call_ms: Timing
    flow_ms: Timing
    vocoder_ms: Timing


@dataclass(frozen=True)
class Both:
    """One LM level decoding while the flow runs one batch size back to back."""

    lm: LmRun
    flow: FlowRun


@dataclass(frozen=True)
class Slowdown:
    """A ``Both`` against the same LM level and flow batch alone (means, ms; ratio = with / alone)."""

    sessions: int
    batch: int
    lm_step_alone: float | None
    lm_step_with_flow: float | None
    flow_call_alone: float | None
    flow_call_with_lm: float | None
    flow_rows_alone: float | None  # rows per call: the two calls compare like with like when equal
    flow_rows_with_lm: float

    @property
    def lm_ratio(self) -> float | None:
        return _ratio(self.lm_step_with_flow, self.lm_step_alone)

    @property
    def flow_ratio(self) -> float | None:
        return _ratio(self.flow_call_with_lm, self.flow_call_alone)

    def row(self) -> dict[str, Any]:
        return asdict(self) | {"lm_ratio": self.lm_ratio, "flow_ratio": self.flow_ratio}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def slowdowns(lm_alone: list[LmRun], flow_alone: list[FlowRun], both: list[Both]) -> list[Slowdown]:
    lm = {r.sessions: r.step_ms.mean for r in lm_alone}
    flow = {r.batch: r for r in flow_alone}
    out = []
    for b in both:
        alone = flow.get(b.flow.batch)
        call, rows = (None, None) if alone is None else (alone.call_ms.mean, alone.rows)
        out.append(
            Slowdown(
                b.lm.sessions,
                b.flow.batch,
                lm.get(b.lm.sessions),
                b.lm.step_ms.mean,
                call,
                b.flow.call_ms.mean,
                rows,
                b.flow.rows,
            )
        )
    return out


Round = tuple[float, list[list[float]]]  # when its decodes started (s), each one's token arrival times (s)


def lm_run(sessions: int, rounds: Sequence[Round]) -> LmRun:
    """Rounds of ``sessions`` decodes started together -> the level's numbers; its wall time is the rounds'
    (each from its start to its last token)."""
    decodes = [s for _, stamps in rounds for s in stamps]
    steps = [(s[-1] - s[0]) / (len(s) - 1) * 1e3 for s in decodes if len(s) > 1]
    gaps = [(b - a) * 1e3 for s in decodes for a, b in itertools.pairwise(s)]
    firsts = [(s[0] - t0) * 1e3 for t0, stamps in rounds for s in stamps if s]
    wall = sum(max((s[-1] for s in stamps if s), default=t0) - t0 for t0, stamps in rounds)
    tokens = sum(len(s) for s in decodes)
    return LmRun(
        sessions, len(rounds), tokens, wall, tokens / wall if wall > 0 else 0.0, Timing.of(steps),
        Timing.of(gaps), Timing.of(firsts),
    )  # fmt: skip


@dataclass(frozen=True)
class Call:
    """One flow + vocoder call as the worker stamped it (s): rows taken, flow done, last row's audio."""

    joined: float
    flow_done: float
    vocoded: float
    rows: int


def calls_of(times: list[Any]) -> list[Call]:
    """Rows' ``ChunkTimes`` -> the calls they ran in (rows taken together share their ``joined`` stamp)."""
    groups: dict[float, list[Any]] = {}
    for t in times:
        if t.joined is not None and t.flow_done is not None and t.vocoded is not None:
            groups.setdefault(t.joined, []).append(t)
    return [
        Call(j, max(t.flow_done for t in rows), max(t.vocoded for t in rows), len(rows))
        for j, rows in sorted(groups.items())
    ]


def flow_run(batch: int, tokens: int, calls: list[Call]) -> FlowRun:
    return FlowRun(
        batch, tokens, len(calls), float(np.mean([c.rows for c in calls])) if calls else 0.0,
        Timing.of([(c.vocoded - c.joined) * 1e3 for c in calls]),
        Timing.of([(c.flow_done - c.joined) * 1e3 for c in calls]),
        Timing.of([(c.vocoded - c.flow_done) * 1e3 for c in calls]),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ the runs


@dataclass
class Probe:
    """What the runs share: the engine, the LM's prompt (prefix embeddings and stop ids) and the flow's
    prompt features, from one planned bench request."""

    engine: Any
    prefix: Any  # [P, H] float32
    stop_ids: tuple[int, ...]
    features: Any  # PromptFeatures
    ids: Iterator[int] = field(default_factory=itertools.count)  # request ids: each decode its own

    @classmethod
    async def of(cls, engine: Any, tokens: int) -> Probe:
        import torch

        req = Workload(tokens=tokens).request(0, prompt_audio())
        plan = await asyncio.to_thread(engine.planner.plan, req)
        text_ids, prompt_ids, speech_ids = plan.segments[0]
        lm = engine.model.lm
        with torch.inference_mode():
            ids = [torch.tensor(x, dtype=torch.long) for x in (text_ids, prompt_ids, speech_ids)]
            prefix = lm.prefix_embeds(*ids)
        return cls(engine, prefix, tuple(sorted(lm.config.stop_ids)), plan.flow_prompt)

    async def decode(self, rid: str, seed: int, tokens: int) -> list[float]:
        """One forced-length decode on the LM backend -> each token's arrival time (s)."""
        from engine.lm.backend import LMRequest

        req = LMRequest(rid, self.prefix, seed, tokens, tokens, self.stop_ids)
        stamps: list[float] = []
        async with contextlib.aclosing(self.engine.backend.generate(req)) as ids:
            async for _ in ids:
                stamps.append(time.perf_counter())
        return stamps

    async def lm_round(self, sessions: int, tokens: int, seed: int) -> Round:
        t0 = time.perf_counter()
        stamps = await asyncio.gather(
            *(self.decode(f"overlap-{next(self.ids)}", seed + i, tokens) for i in range(sessions))
        )
        return t0, list(stamps)

    async def lm_level(self, sessions: int, tokens: int, rounds: int, seed: int) -> LmRun:
        """``rounds`` rounds of ``sessions`` decodes, one round after another."""
        return lm_run(
            sessions, [await self.lm_round(sessions, tokens, seed + 1000 * r) for r in range(rounds)]
        )

    async def flow_call(self, batch: int, tokens: int, seed: int) -> list[Any]:
        """``batch`` whole-utterance final calls of ``tokens`` tokens queued together -> their rows'
        ``ChunkTimes``. Queued in one go, with no await between them, so the worker finds them all (its
        ``flow_batch`` may still cut them; ``FlowRun.rows`` says how many shared a call)."""
        from engine.serving.streaming import ChunkJob

        t2w, speech, loop = (
            self.engine.token2wav,
            list(self.features.speech_tokens),
            asyncio.get_running_loop(),
        )
        jobs = []
        for i in range(batch):
            utt = t2w.utterance(self.features, seed + i, stream=False)
            utt.tokens.extend((speech * (tokens // max(len(speech), 1) + 1))[:tokens])
            jobs.append(t2w.scheduler.job(utt, ChunkJob(tokens, 0, True), loop, None))
        for job in jobs:
            t2w.scheduler.submit(job)
        await asyncio.gather(*(job.future for job in jobs))
        return [job.times for job in jobs]

    async def flow_level(self, batch: int, tokens: int, calls: int, seed: int) -> FlowRun:
        """``calls`` flow calls of ``batch`` rows, one after another."""
        times: list[Any] = []
        for i in range(calls):
            times += await self.flow_call(batch, tokens, seed + i)
        return flow_run(batch, tokens, calls_of(times))

    async def flow_loop(self, batch: int, tokens: int, stop: asyncio.Event) -> None:
        """Flow calls of ``batch`` rows back to back until ``stop``."""
        while not stop.is_set():
            await self.flow_call(batch, tokens, seed=2 * 10**6)

    async def lm_loop(self, sessions: int, tokens: int, stop: asyncio.Event) -> None:
        """Rounds of ``sessions`` decodes back to back until ``stop``."""
        while not stop.is_set():
            await self.lm_round(sessions, tokens, seed=4 * 10**6)


async def alongside(
    background: Callable[[asyncio.Event], Coroutine[Any, Any, None]], timed: Awaitable[T]
) -> T:
    """``timed`` while ``background(stop)`` keeps the device busy; the background stops after it."""
    stop = asyncio.Event()
    task = asyncio.create_task(background(stop))
    try:
        await asyncio.sleep(0)  # the background's first work is submitted before the timed work starts
        return await timed
    finally:
        stop.set()
        await task


async def lm_alone(probe: Probe, levels: Sequence[int], tokens: int, rounds: int) -> list[LmRun]:
    out = []
    for c in levels:
        await probe.lm_round(c, min(tokens, 32), seed=10**6)  # untimed: the level's shapes once
        run = await probe.lm_level(c, tokens, rounds, seed=0)
        log.info("LM alone, %d decodes: %.0f tokens/s, step %s ms", c, run.tokens_per_s, _ms(run.step_ms))
        out.append(run)
    return out


async def lm_profiles(backend: Any, probe: Probe, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One round of each LM level alone under vLLM's profiler -> its table per level, copied to
    OUT/lm_profile_cN.txt, with the round's steps (the table's totals over them: per-step device time)."""
    out = []
    for c in args.lm_levels:
        await backend.start_profile()
        try:
            run = await probe.lm_level(c, args.tokens, 1, seed=7)
        finally:
            table = await backend.stop_profile()
        kept = Path(args.out) / f"lm_profile_c{c}.txt"
        shutil.copyfile(table, kept)
        steps = run.tokens // c  # engine steps: one token of every decode each
        out.append({"decodes": c, "table": kept.name, "steps": steps, "step_ms": asdict(run.step_ms)})
        log.info("LM profile, %d decodes: %s", c, kept)
    return out


async def flow_alone(probe: Probe, batches: Sequence[int], tokens: int, calls: int) -> list[FlowRun]:
    out = []
    for b in batches:
        await probe.flow_call(b, tokens, seed=10**6)  # untimed
        run = await probe.flow_level(b, tokens, calls, seed=0)
        log.info("flow alone, batch %d: call %s ms", b, _ms(run.call_ms))
        out.append(run)
    return out


async def both(probe: Probe, sessions: int, batch: int, args: argparse.Namespace) -> Both:
    """The LM level ``sessions`` timed while the flow runs batches of ``batch`` back to back, then the
    flow's batches timed while the LM decodes that level round after round."""
    tokens, flow_tokens = args.tokens, args.flow_tokens
    lm = await alongside(
        lambda stop: probe.flow_loop(batch, flow_tokens, stop),
        probe.lm_level(sessions, tokens, args.rounds, seed=3 * 10**6),
    )
    flow = await alongside(
        lambda stop: probe.lm_loop(sessions, tokens, stop),
        probe.flow_level(batch, flow_tokens, args.flow_calls, seed=5 * 10**6),
    )
    log.info(
        "both, %d decodes + flow batch %d: LM step %s ms, flow call %s ms",
        sessions, batch, _ms(lm.step_ms), _ms(flow.call_ms),
    )  # fmt: skip
    return Both(lm, flow)


def _ms(t: Timing) -> str:
    return "-" if t.mean is None else f"mean {t.mean:.2f} p50 {t.p50:.2f} p95 {t.p95:.2f}"


# ------------------------------------------------------------------------------------------ the report


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    head = [
        f"# LM and flow on one device: arm {meta.get('arm', '-')}",
        "",
        f"{meta.get('model', '')} on {meta.get('hardware', '')} ({meta.get('backend', '')}, "
        f"{meta.get('device', '')}); {meta.get('tokens')} LM tokens per decode, "
        f"{meta.get('flow_tokens')} tokens per flow row; git {meta.get('git', '')}",
    ]
    sections = (_slowdown_table, _lm_table, _flow_table, _e2e_table)
    return "\n".join(head + [line for table in sections for line in ["", *table(result)]]) + "\n"


def _table(header: str, rows: list[str]) -> list[str]:
    return [header, "|" + "---|" * (header.count("|") - 1), *rows]


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _slowdown_table(result: dict[str, Any]) -> list[str]:
    rows = [
        _row(
            r["sessions"],
            r["batch"],
            _f(r["lm_step_alone"]),
            _f(r["lm_step_with_flow"]),
            _x(r["lm_ratio"]),
            _f(r["flow_call_alone"]),
            _f(r["flow_call_with_lm"]),
            _x(r["flow_ratio"]),
            f"{_f(r['flow_rows_alone'])} / {_f(r['flow_rows_with_lm'])}",
        )
        for r in result.get("slowdowns", [])
    ]
    header = _row(
        "LM decodes", "flow batch", "LM step ms alone", "with flow", "LM slowdown", "flow call ms alone",
        "with LM", "flow slowdown", "rows per flow call alone / with LM",
    )  # fmt: skip
    return _table(header, rows)


def _lm_table(result: dict[str, Any]) -> list[str]:
    rows = [
        _row(
            r["sessions"],
            f"{r['tokens_per_s']:.0f}",
            _f(r["step_ms"]["p50"]),
            _f(r["step_ms"]["p95"]),
            _f(r["gap_ms"]["p95"]),
            _f(r["first_token_ms"]["p50"]),
        )
        for r in result.get("lm_alone", [])
    ]
    header = _row("LM alone: decodes", "tokens/s", "step ms p50", "p95", "gap ms p95", "first token ms p50")
    return _table(header, rows)


def _flow_table(result: dict[str, Any]) -> list[str]:
    rows = [
        _row(
            r["batch"],
            r["calls"],
            f"{r['rows']:.1f}",
            _f(r["call_ms"]["p50"]),
            _f(r["call_ms"]["p95"]),
            _f(r["flow_ms"]["p50"]),
            _f(r["vocoder_ms"]["p50"]),
        )
        for r in result.get("flow_alone", [])
    ]
    header = _row(
        "flow alone: batch", "calls", "rows per call", "call ms p50", "p95", "flow ms p50", "vocoder ms p50"
    )
    return _table(header, rows)


def _e2e_table(result: dict[str, Any]) -> list[str]:
    rows = [
        _row(
            lv["concurrency"],
            _f(lv["ttfa_ms"]["p50"]),
            _f(lv["ttfa_ms"]["p95"]),
            _f(lv["rtf"]["p50"], ".3f"),
            " / ".join(_f(lv["stage_ms_mean"].get(k)) for k in ("lm", "flow", "hift")),
        )
        for lv in result.get("e2e", [])
    ]
    header = _row("stream bench: streams", "TTFA p50 ms", "TTFA p95 ms", "RTF p50", "LM / flow / HiFT ms")
    return _table(header, rows)


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def write(result: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown(result))
    return out / "results.json"


# ------------------------------------------------------------------------------------------ the command


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Our flags, then ``python -m bench``'s (the engine, ``--concurrency``, ``--tokens``, ``--out`` ...)."""
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", default="default", help="the arm's name in the report (which flags it has)")
    p.add_argument("--lm-levels", type=bench.int_list, default=[1, 16], help="concurrent LM decodes")
    p.add_argument("--flow-batches", type=bench.int_list, default=[1, 16], help="rows per flow call")
    p.add_argument("--flow-tokens", type=int, default=250, help="speech tokens per flow row (25 = 1 s)")
    p.add_argument("--rounds", type=int, default=3, help="LM rounds per level (each: all its decodes)")
    p.add_argument("--flow-calls", type=int, default=5, help="timed flow calls per batch size alone")
    p.add_argument("--no-e2e", action="store_true", help="leave out the end-to-end stream bench")
    p.add_argument(
        "--lm-profile", action="store_true",
        help="vLLM's torch profiler over one round of each LM level alone: OUT/lm_profile_cN.txt (its engine "
        "core's kernels and ops by device time; traces in OUT/lm_profile/)",
    )  # fmt: skip
    ours, rest = p.parse_known_args(argv)
    args = bench.parse_args([*rest, "--modes", "stream"])
    for key, value in vars(ours).items():
        setattr(args, key, value)
    if args.url or args.baseline or args.arrivals != "closed":
        p.error(
            "the overlap bench drives the in-process engine in closed waves: no --url, --baseline, --arrivals"
        )
    if max(args.flow_batches) > bench.busiest(args) or max(args.lm_levels) > 128:
        p.error("--flow-batches must fit the engine's slots (the largest --concurrency); --lm-levels <= 128")
    if not 1 <= args.flow_tokens <= 3000 or args.rounds < 1 or args.flow_calls < 1:
        p.error("--flow-tokens within [1, 3000], --rounds and --flow-calls >= 1")
    args.graph_warmup_s = max(bench.warmup_s(args), args.flow_tokens / 25 + bench.PROMPT_S + bench.MARGIN_S)
    if args.lm_profile and args.backend != "vllm":
        p.error("--lm-profile profiles vLLM's engine core: add --backend vllm")
    args.lm_profile_dir = str(Path(args.out) / "lm_profile") if args.lm_profile else None
    return args


async def measure(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from engine import device as devices

    engine = bench.load_engine(args)
    result: dict[str, Any] = {"meta": {}}

    def save(**parts: Any) -> None:
        result.update(parts)
        write(result, Path(args.out))

    try:
        info = {"model": f"{engine.model_name} ({engine.family})", "device": str(engine.model.device)}
        info |= {"backend": engine.backend.name, "arm": args.arm, "flow_tokens": args.flow_tokens}
        result["meta"] = bench.meta(args, argv, info) | {"complete": False}
        await engine.warmup()
        await asyncio.to_thread(engine.graph_builder.wait)  # every flow call replays a captured graph
        probe = await Probe.of(engine, args.tokens)
        lm = await lm_alone(probe, args.lm_levels, args.tokens, args.rounds)
        save(lm_alone=[asdict(r) for r in lm])
        if args.lm_profile:
            save(lm_profiles=await lm_profiles(engine.backend, probe, args))
        flow = await flow_alone(probe, args.flow_batches, args.flow_tokens, args.flow_calls)
        save(flow_alone=[asdict(r) for r in flow])
        pairs = [await both(probe, c, b, args) for c in args.lm_levels for b in args.flow_batches]
        save(both=[asdict(b) for b in pairs], slowdowns=[s.row() for s in slowdowns(lm, flow, pairs)])
        if not args.no_e2e:
            await e2e(engine, args, save)
        if args.profile_dir:
            await bench.profile_levels(EngineTarget(engine), args)
        result["meta"] |= {"complete": True, "device_peak_mb": devices.peak_memory_mb(engine.model.device)}
        save()
        return result
    finally:
        engine.close()


async def e2e(engine: Any, args: argparse.Namespace, save: Any) -> list[Level]:
    """The stream bench's own sweep at ``--concurrency`` (its warm-up, levels and checks)."""

    def keep(levels: list[Level]) -> None:
        save(e2e=[bench.untraced(asdict(lv)) for lv in levels])

    return await bench.sweep(EngineTarget(engine), args, args.concurrency, keep)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = asyncio.run(measure(args, argv))
    log.info("results: %s", Path(args.out) / "results.json")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
