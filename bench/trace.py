"""``python -m bench.trace OUT/trace.jsonl[.gz]``: where the time went, per open-loop rate, from chunk traces.

Every row is one sent chunk (``engine.serving.metrics.ChunkTrace``, ms after its request was submitted).
Per rate it prints the first chunks (the time to first audio: LM until the chunk's tokens were ready, the
wait for the token2wav worker, flow + vocoder; and the p95 had none of them waited for the worker, the most
a scheduler that never makes a first chunk wait could give; how many the first-chunk lane ran; by the first
chunk's length: v3's fast start splits 16 tokens off the reference's 41 at the bench's prompt; prompts of
many lengths give many, printed as two bands, split and the reference's), the later
ones (how many missed their playback deadline, and whether the missed ones waited or computed), the LM's
part of first chunks by the load their requests started in (its first token, then each later one: how much
other streams' decodes and the flow's calls beside them slow it), the LM's first token by how much of the main
worker's call was left as its request was sent (a request's device work queued behind that call), the first
token in parts (the frontend, the prompt embeddings, then the LM: at the median and for the slowest first
chunks), the batches
(rows, and the share of flow frames that were padding to the batch's frame bucket: a fragmented mix of
lengths pays it) and the hand-off to the client.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load import percentile
from bench.open_loop import OpenLoop
from engine.config import StreamConfig

Row = dict[str, Any]


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _span(row: Row, start: str, end: str) -> float | None:
    a, b = row.get(start), row.get(end)
    return None if a is None or b is None else b - a


@dataclass(frozen=True)
class FirstLength:
    """The first chunks of one length (tokens: v3's fast start splits 16 off the reference's 41): how many,
    when sent (ms), and the engine's load as their requests started (what the fast start's rule read;
    None in traces from before it was recorded)."""

    tokens: int  # the shortest of them
    count: int
    sent_p50: float | None
    sent_p95: float | None
    computing_p50: float | None  # requests computing, this one included
    computing_max: int | None
    recent_p50: float | None  # requests that started within StreamConfig.fast_start_burst_s
    top: int | None = None  # a band of lengths: the longest (None: all are ``tokens`` long)
    band: str = ""  # the band's name (split, reference)

    def line(self, f: Any) -> str:
        load = ""
        if self.computing_p50 is not None:
            recent = "" if self.recent_p50 is None else f", started within the window p50 {self.recent_p50:g}"
            computing = f"computing p50 {self.computing_p50:g}, max {self.computing_max}"
            load = f" (at their start: {computing}{recent})"
        sent = f"sent p50 {f(self.sent_p50)} / p95 {f(self.sent_p95)} ms"
        size = (
            f"{self.tokens} tokens" if self.top is None else f"{self.band}, {self.tokens}-{self.top} tokens"
        )
        return f"{size}: {self.count}, {sent}{load}"


@dataclass(frozen=True)
class LmPace:
    """The LM's part of the first chunks whose requests started while ``low``..``high`` requests computed
    (this one included; ``high`` None: or more), p50s in ms: submit -> the first speech token (the queue, the
    prompt's features and text work and the prefill included), then each later token until the chunk's
    were ready."""

    low: int
    high: int | None
    count: int
    first_token_p50: float | None
    per_token_p50: float | None

    def part(self, f: Any) -> str:
        load = f"{self.low}+" if self.high is None else f"{self.low}-{self.high}"
        load = str(self.low) if self.high == self.low else load
        per = "-" if self.per_token_p50 is None else f"{self.per_token_p50:.1f}"
        return f"{load} computing: {self.count}, first token {f(self.first_token_p50)} + {per} ms a token"


@dataclass(frozen=True)
class FirstStart:
    """First chunks by where their flow call started (EngineConfig.flow_voice_pages): after a kept voice's
    prompt pages (``cached_frames`` > 0) or at frame 0; p50s in ms."""

    kept: bool
    count: int
    flow_p50: float | None  # taken -> flow done
    sent_p50: float | None

    def part(self, f: Any) -> str:
        name = "after a kept voice's prompt pages" if self.kept else "from frame 0"
        return f"{name}: {self.count}, flow p50 {f(self.flow_p50)}, sent p50 {f(self.sent_p50)} ms"


@dataclass(frozen=True)
class BehindCall:
    """First tokens of requests sent while the main token2wav worker's call had ``low``..``high`` ms left to
    run (``low`` None: no call running; ``high`` None: or more); p50 in ms after submit. A request's prompt
    embeddings and copies on the device stream the worker's call is on wait for that call to end."""

    low: float | None
    high: float | None
    count: int
    first_token_p50: float | None

    def part(self, f: Any) -> str:
        if self.low is None:
            left = "none running"
        else:
            left = f"{self.low:g}+ ms left" if self.high is None else f"{self.low:g}-{self.high:g} ms left"
        return f"{left}: {self.count}, first token p50 {f(self.first_token_p50)}"


@dataclass(frozen=True)
class TokenParts:
    """A group of first chunks' first token in parts, ms: submit -> the frontend done (prompt features and
    text), -> the flow's prompt tensors made on the device, -> the LM's prompt embeddings made, -> the first
    speech token (host copy, the backend's queue and prefill); ``stat`` says which statistic of the group
    (p50s of all, means of the slowest by sent). ``flow_prompt`` is None in traces before it was recorded,
    where ``embeddings`` holds it too."""

    group: str
    stat: str
    count: int
    frontend: float | None
    embeddings: float | None
    lm: float | None
    flow_prompt: float | None = None

    def part(self, f: Any) -> str:
        flow = "" if self.flow_prompt is None else f"flow prompt {f(self.flow_prompt)} + "
        parts = f"frontend {f(self.frontend)} + {flow}embeddings {f(self.embeddings)} + LM {f(self.lm)} ms"
        return f"{self.group} ({self.count}, {self.stat}): {parts}"


@dataclass(frozen=True)
class RateSummary:
    """One (mode, rate)'s chunks; times in ms (means unless named)."""

    mode: str
    rate: float | None
    requests: int
    system: str  # the run's arm (``cosystream``, ``cosystream relaxed-cap``); empty in traces before the A/B
    chunks: int
    first_sent_p50: float | None  # the engine-side time to first audio
    first_sent_p95: float | None
    first_unwaited_p95: float | None  # the p95 had no first chunk waited for the worker (sent - that wait)
    first_seam_p95: float | None  # the p95 had each waited only for the running call's flow (``seam_sent``)
    first_waited: int  # first chunks that waited for the worker over 1 ms
    first_behind_spare: int  # of them, ready while it ran a call of rows with seconds to spare
    first_lm: float | None  # submit -> the first chunk's tokens ready (text work, queue, LM)
    first_wait: float | None  # ready -> taken in a batch
    first_compute: float | None  # taken -> vocoded
    later: int
    later_missed: int  # sent after the client's audio ran out
    missed_wait: float | None  # the missed chunks: ready -> taken
    missed_compute: float | None  # the missed chunks: taken -> vocoded
    later_wait_p95: float | None
    batch_rows: float | None  # rows per flow batch, seen from its rows
    padding_share: float  # padded frames / bucket frames, over every row
    flow: float | None
    vocoder: float | None
    hand_off: float | None  # vocoded -> sent
    seed: int = 0  # the arrivals' seed (the bench runs each rate once per seed)
    first_on_lane: int = 0  # first chunks the first-chunk lane ran (EngineConfig.t2w_first_lane)
    # per first-chunk length, shortest first; traces before chunks named their tokens: none
    first_by_tokens: tuple[FirstLength, ...] = ()
    # the LM's part of first chunks by the load their requests started in; traces before it was recorded: none
    lm_by_load: tuple[LmPace, ...] = ()
    # where any first chunk began after a kept voice's pages (traces before cached_frames: none)
    first_starts: tuple[FirstStart, ...] = ()
    # the LM's first token by the main worker's call left at submit (traces without first tokens: none)
    behind_call: tuple[BehindCall, ...] = ()
    # the first token in parts: every first chunk, the slowest (traces before the parts were recorded: none)
    token_parts: tuple[TokenParts, ...] = ()

    def lines(self) -> list[str]:
        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.0f}"

        missed = 100.0 * self.later_missed / self.later if self.later else 0.0
        return [
            f"{self.mode}{f' [{self.system}]' if self.system else ''} at {self.rate} requests/s, seed "
            f"{self.seed}: "
            f"{self.requests} requests, {self.chunks} chunks",
            f"  first chunks: sent p50 {f(self.first_sent_p50)} / p95 {f(self.first_sent_p95)} ms = tokens "
            f"ready {f(self.first_lm)} + wait for the worker {f(self.first_wait)} + flow and vocoder "
            f"{f(self.first_compute)} (means); p95 {f(self.first_unwaited_p95)} ms had none waited for "
            f"the worker, {f(self.first_seam_p95)} ms had they waited only for a running flow at its seam",
            f"  first chunks that waited for the worker: {self.first_waited}, {self.first_behind_spare} of "
            f"them behind a call of rows with over {SEAM_SLACK_MS / 1000:.0f} s to spare; "
            f"{self.first_on_lane} of {self.requests} ran on the first-chunk lane",
            *self._by_tokens(f),
            *self._lm_by_load(f),
            *self._starts(f),
            *self._behind(f),
            *self._token_parts(f),
            f"  later chunks: {self.later_missed} of {self.later} missed their deadline ({missed:.1f} %); "
            f"the missed waited {f(self.missed_wait)} and computed {f(self.missed_compute)} ms; wait p95 "
            f"{f(self.later_wait_p95)} ms",
            f"  batches: {self.batch_rows or 0:.1f} rows, {100 * self.padding_share:.1f} % of flow frames "
            f"padding; flow {f(self.flow)}, vocoder {f(self.vocoder)}, hand-off {f(self.hand_off)} ms",
        ]

    def _by_tokens(self, f: Any) -> list[str]:
        """The first chunks' line by length, where the trace names their tokens."""
        parts = [length.line(f) for length in self.first_by_tokens]
        return [f"  first chunks by length: {'; '.join(parts)}"] if parts else []

    def _lm_by_load(self, f: Any) -> list[str]:
        """The LM's pace for first chunks by load, where the trace has their first tokens and load."""
        parts = [pace.part(f) for pace in self.lm_by_load]
        return [f"  the LM's first-chunk tokens by load (p50s): {'; '.join(parts)}"] if parts else []

    def _starts(self, f: Any) -> list[str]:
        parts = [start.part(f) for start in self.first_starts]
        return [f"  first chunks {'; '.join(parts)}"] if parts else []

    def _token_parts(self, f: Any) -> list[str]:
        parts = [group.part(f) for group in self.token_parts]
        return [f"  the first token in parts: {'; '.join(parts)}"] if parts else []

    def _behind(self, f: Any) -> list[str]:
        parts = [band.part(f) for band in self.behind_call]
        head = "  the LM's first token by the main worker's call at submit"
        return [f"{head}: {'; '.join(parts)}"] if parts else []


# a first chunk shorter than this (tokens: a chunk and v3's look-ahead) was split by the fast start: it ends
# on the grid line after the prompt, the reference's one grid line later
SPLIT_BELOW = StreamConfig.token_hop + StreamConfig.lookahead
MAX_LENGTHS = 4  # more distinct lengths (prompts of many lengths: --prompt-spread) print as two bands


def _by_tokens(first: list[Row]) -> tuple[FirstLength, ...]:
    """The first chunks by length, shortest first; with more than MAX_LENGTHS lengths, as two bands: the
    split ones and the reference's."""
    rows = [r for r in first if "tokens" in r]
    lengths = sorted({r["tokens"] for r in rows})
    if len(lengths) <= MAX_LENGTHS:
        return tuple(_length(t, [r for r in rows if r["tokens"] == t]) for t in lengths)
    split = [r for r in rows if r["tokens"] < SPLIT_BELOW]
    reference = [r for r in rows if r["tokens"] >= SPLIT_BELOW]
    return tuple(_band(name, band) for name, band in (("split", split), ("reference", reference)) if band)


def _band(name: str, rows: list[Row]) -> FirstLength:
    tokens = [r["tokens"] for r in rows]
    return dataclasses.replace(_length(min(tokens), rows), top=max(tokens), band=name)


def _length(tokens: int, rows: list[Row]) -> FirstLength:
    sent = [r["sent_ms"] for r in rows]
    computing = [r["computing_at_start"] for r in rows if r.get("computing_at_start") is not None]
    recent = [r["recent_starts"] for r in rows if r.get("recent_starts") is not None]
    return FirstLength(
        tokens,
        len(rows),
        percentile(sent, 50),
        percentile(sent, 95),
        percentile(computing, 50) if computing else None,
        max(computing) if computing else None,
        percentile(recent, 50) if recent else None,
    )


# requests computing as a first chunk's request started (itself included): alone, beside a few, beside many
LOAD_BANDS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 4), (5, 9), (10, None))


def _lm_by_load(first: list[Row]) -> tuple[LmPace, ...]:
    """The first chunks' LM pace per ``LOAD_BANDS`` band that has any (rows naming their first token, tokens
    and load only)."""
    keys = ("lm_first_token_ms", "tokens", "computing_at_start")
    rows = [r for r in first if all(r.get(k) is not None for k in keys)]
    paces = []
    for low, high in LOAD_BANDS:
        band = [
            r
            for r in rows
            if low <= r["computing_at_start"] and (high is None or r["computing_at_start"] <= high)
        ]
        if band:
            paces.append(_pace(low, high, band))
    return tuple(paces)


def _pace(low: int, high: int | None, rows: list[Row]) -> LmPace:
    first = [r["lm_first_token_ms"] for r in rows]
    # [first token, tokens ready] holds the chunk's other tokens: a chunk of one token has none to time
    per = [(r["ready_ms"] - r["lm_first_token_ms"]) / (r["tokens"] - 1) for r in rows if r["tokens"] > 1]
    return LmPace(low, high, len(rows), percentile(first, 50), percentile(per, 50) if per else None)


def summarise(rows: Sequence[Row], seed: int = 0) -> list[RateSummary]:
    """Per (mode, arm, rate, arrival seed); ``seed``: the bench's, which placed the requests' arrivals, for
    rows that do not name their own (traces before the seeds were recorded)."""
    groups: dict[tuple[str, str, float | None, int], list[Row]] = {}
    for row in rows:
        key = (row["mode"], row.get("system", ""), row.get("rate"), row.get("seed", seed))
        groups.setdefault(key, []).append(row)
    return [_summary(m, system, rate, group, s) for (m, system, rate, s), group in groups.items()]


def _summary(mode: str, system: str, rate: float | None, rows: list[Row], seed: int) -> RateSummary:
    first = [r for r in rows if r["first"]]
    later = [r for r in rows if not r["first"]]
    missed = [r for r in later if r["slack_ms"] < 0]
    clock = on_one_clock(rows, seed) if rate else None  # the replays below need the run's clock
    waited, spare = behind_spare(rows, clock) if clock else (0, 0)
    bucket = sum(r["bucket_frames"] for r in rows)
    padding = sum(r["bucket_frames"] - r["frames"] for r in rows)
    return RateSummary(
        mode=mode,
        system=system,
        rate=rate,
        seed=seed,
        requests=len({r["request"] for r in rows}),
        chunks=len(rows),
        first_sent_p50=percentile([r["sent_ms"] for r in first], 50),
        first_sent_p95=percentile([r["sent_ms"] for r in first], 95),
        first_unwaited_p95=percentile(
            [r["sent_ms"] - w for r in first if (w := _span(r, "ready_ms", "joined_ms")) is not None], 95
        ),
        first_seam_p95=percentile(seam_sent(rows, clock), 95) if clock else None,
        first_waited=waited,
        first_behind_spare=spare,
        first_lm=_mean(r["ready_ms"] for r in first),
        first_wait=_mean(_span(r, "ready_ms", "joined_ms") for r in first),
        first_compute=_mean(_span(r, "joined_ms", "vocoded_ms") for r in first),
        later=len(later),
        later_missed=len(missed),
        missed_wait=_mean(_span(r, "ready_ms", "joined_ms") for r in missed),
        missed_compute=_mean(_span(r, "joined_ms", "vocoded_ms") for r in missed),
        later_wait_p95=percentile(
            [w for r in later if (w := _span(r, "ready_ms", "joined_ms")) is not None], 95
        ),
        batch_rows=_mean(r["batch"] for r in rows),
        padding_share=padding / bucket if bucket else 0.0,
        flow=_mean(_span(r, "joined_ms", "flow_done_ms") for r in rows),
        vocoder=_mean(_span(r, "flow_done_ms", "vocoded_ms") for r in rows),
        hand_off=_mean(_span(r, "vocoded_ms", "sent_ms") for r in rows),
        first_on_lane=sum(r.get("lane") == "first" for r in first),  # traces before the lane: none
        first_by_tokens=_by_tokens(first),
        lm_by_load=_lm_by_load(first),
        first_starts=_starts(first),
        behind_call=behind_call(rows, clock) if clock else (),
        token_parts=token_parts(first),
    )


SLOWEST = 0.05  # token_parts' second group: this share of the first chunks, the latest sent


def token_parts(first: list[Row]) -> tuple[TokenParts, ...]:
    """The first token's parts over every first chunk that has them (p50s), then over the slowest
    ``SLOWEST`` of them by sent (means: a handful of chunks)."""
    keys = ("frontend_ms", "prefix_ms", "lm_first_token_ms")
    rows = [r for r in first if all(r.get(k) is not None for k in keys)]
    if not rows:
        return ()
    slowest = sorted(rows, key=lambda r: r["sent_ms"])[-max(1, round(SLOWEST * len(rows))) :]
    return (
        _parts("all", "p50s", rows, lambda v: percentile(v, 50)),
        _parts("slowest 5 %", "means", slowest, _mean),
    )


def _parts(group: str, stat: str, rows: list[Row], of: Any) -> TokenParts:
    split = all(r.get("flow_prompt_ms") is not None for r in rows)
    before = "flow_prompt_ms" if split else "frontend_ms"  # the embeddings' span starts after the flow prompt
    spans = [
        [r["frontend_ms"] for r in rows],
        [r["prefix_ms"] - r[before] for r in rows],
        [r["lm_first_token_ms"] - r["prefix_ms"] for r in rows],
    ]
    flow = of([r["flow_prompt_ms"] - r["frontend_ms"] for r in rows]) if split else None
    frontend, embeddings, lm = (of(span) for span in spans)
    return TokenParts(group, stat, len(rows), frontend, embeddings, lm, flow)


def _starts(first: list[Row]) -> tuple[FirstStart, ...]:
    """The first chunks after a kept voice's pages and the others, where any began after them."""
    if not any(r.get("cached_frames", 0) > 0 for r in first):
        return ()
    out = []
    for kept in (True, False):
        rows = [r for r in first if (r.get("cached_frames", 0) > 0) == kept]
        flow = [w for r in rows if (w := _span(r, "joined_ms", "flow_done_ms")) is not None]
        sent = [r["sent_ms"] for r in rows]
        out.append(FirstStart(kept, len(rows), percentile(flow, 50), percentile(sent, 50)))
    return tuple(out)


SEAM_SLACK_MS = StreamConfig.relaxed_slack_s * 1000.0  # the worker's seam opens for rows with more to spare


def on_one_clock(rows: list[Row], seed: int = 0) -> dict[str, list[float]]:
    """One rate's rows (one arm) on the run's clock: request i was sent at its seeded Poisson arrival
    (``bench.open_loop``, the bench's ``--seed``), so each stamp is that plus its ms. -> column -> values
    (ms from the level's start), in the rows' order."""
    rate, count = rows[0]["rate"], 1 + max(r["request"] for r in rows)
    sends = OpenLoop(rate, count).arrivals(random.Random(seed))
    keys = ("ready_ms", "joined_ms", "flow_done_ms", "vocoded_ms", "deadline_ms")
    return {k: [1000.0 * sends[r["request"]] + r[k] for r in rows] for k in keys}


def _running(clock: dict[str, list[float]], i: int) -> list[int]:
    """The rows (indices) of the calls running when row ``i``'s tokens were ready."""
    ready = clock["ready_ms"][i]
    stamps = zip(clock["joined_ms"], clock["vocoded_ms"], strict=True)
    return [j for j, (start, end) in enumerate(stamps) if j != i and start <= ready < end]


def behind_spare(rows: list[Row], clock: dict[str, list[float]]) -> tuple[int, int]:
    """(first chunks that waited for the worker, those of them whose tokens were ready while it ran a call
    of rows that all had over ``SEAM_SLACK_MS`` to spare then): how much of the wait is for audio nobody
    needed yet. ``clock``: the rows on the run's clock (``on_one_clock``)."""
    waited = [i for i, r in enumerate(rows) if r["first"] and r["joined_ms"] - r["ready_ms"] > 1.0]
    spare = [
        i
        for i in waited
        if (running := _running(clock, i))
        and all(clock["deadline_ms"][j] - clock["ready_ms"][i] > SEAM_SLACK_MS for j in running)
    ]
    return len(waited), len(spare)


def seam_sent(rows: list[Row], clock: dict[str, list[float]]) -> list[float]:
    """Each first chunk's sent time (ms after submit) had the worker opened the seam of the call running when
    its tokens were ready (every row of that call over ``SEAM_SLACK_MS`` of slack at the flow's end, the
    chunk ready before it): it waits for the rest of that flow, then computes as it did. Chunks that did
    not wait, or were ready after the flow, keep their times. ``clock``: as for ``behind_spare``."""
    out = []
    for i, row in enumerate(rows):
        if not row["first"]:
            continue
        ready, waited = clock["ready_ms"][i], row["joined_ms"] - row["ready_ms"]
        running = _running(clock, i)
        seam = min((clock["flow_done_ms"][j] for j in running), default=math.inf)
        spare = all(clock["deadline_ms"][j] - seam > SEAM_SLACK_MS for j in running)
        opens = ready < seam < math.inf and spare
        out.append(row["sent_ms"] - waited + (seam - ready if opens else waited))
    return out


# ms of the main worker's call left to run as a request was sent: the bands of ``behind_call``
LEFT_BANDS: tuple[tuple[float, float | None], ...] = ((0.0, 20.0), (20.0, 40.0), (40.0, None))


def main_calls(rows: list[Row], clock: dict[str, list[float]]) -> list[tuple[float, float]]:
    """The main worker's calls as (joined, vocoded) on the run's clock, one per row it ran (traces from
    before the first-chunk lane name no lane: every row is the main worker's)."""
    spans = zip(clock["joined_ms"], clock["vocoded_ms"], strict=True)
    return [span for row, span in zip(rows, spans, strict=True) if row.get("lane", "main") == "main"]


def behind_call(rows: list[Row], clock: dict[str, list[float]]) -> tuple[BehindCall, ...]:
    """The first chunks' LM first token (ms after submit) by how much of a main-worker call was left to run
    when their request was sent (the longest such call; ``LEFT_BANDS``), and with none running."""
    calls = main_calls(rows, clock)
    left: list[tuple[float | None, float]] = []
    for i, row in enumerate(rows):
        if row["first"] and row.get("lm_first_token_ms") is not None:
            sent = clock["ready_ms"][i] - row["ready_ms"]
            running = [end - sent for start, end in calls if start <= sent < end]
            left.append((max(running) if running else None, row["lm_first_token_ms"]))
    if not left:
        return ()
    bands = [BehindCall(None, None, *_tokens([t for ms, t in left if ms is None]))]
    for low, high in LEFT_BANDS:
        band = [t for ms, t in left if ms is not None and low <= ms and (high is None or ms < high)]
        bands.append(BehindCall(low, high, *_tokens(band)))
    return tuple(band for band in bands if band.count)


def _tokens(first_tokens: list[float]) -> tuple[int, float | None]:
    return len(first_tokens), percentile(first_tokens, 50) if first_tokens else None


def read(path: Path) -> list[Row]:
    """The rows of a trace.jsonl, or of its gzipped copy (``.gz``, as results keep it)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv: Sequence[str] | None = None) -> list[RateSummary]:
    p = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a trace.jsonl written by python -m bench --trace")
    p.add_argument("--seed", type=int, default=0, help="the bench run's --seed (its arrivals)")
    args = p.parse_args(argv)
    found = summarise(read(args.trace), args.seed)
    for summary in found:
        print("\n".join(summary.lines()))
    return found


if __name__ == "__main__":
    main()
