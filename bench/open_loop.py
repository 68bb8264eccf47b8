"""Open-loop load: requests arrive as a Poisson process at a fixed rate, whatever the server is doing.

Closed-loop waves (``bench.load.run_level``) send the next request only when one finishes, so a slow server
is offered less work; real visitors do not wait for each other. Here request i is sent at its own arrival
time (exponential gaps of mean 1 / rate s, seeded), with a length drawn uniformly from
[tokens x (1 - spread), tokens x (1 + spread)] speech tokens (25 tokens = 1 s of audio; the bench fixes
the length with ``forced_tokens``, so the drawn length is the compute the request costs). The level reports
the same client-side TTFA, RTF and underruns as a closed-loop one, plus how many streams were active.

A figure to quote is a steady state: the active streams take tens of seconds to build up at a rate near
capacity, so a rate runs for minutes of arrivals (the bench's default 120 s), its TTFA is reported per
window of arrivals beside the whole (flat windows: steady; rising ones: a queue still building), and it
runs once per arrival seed, a rate counting as met only when every seed meets the SLO.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import numpy as np

from bench.load import (
    Level,
    RequestResult,
    Target,
    Window,
    Workload,
    one_request,
    percentile,
    server_mean_ms,
    summarize,
)


@dataclasses.dataclass(frozen=True)
class Slo:
    """What a rate must meet to count as served: no failed request, no stream that ran dry, and the time to
    first audio at p95 at or under ``ttfa_p95_ms``."""

    ttfa_p95_ms: float = 300.0

    def __post_init__(self) -> None:
        if self.ttfa_p95_ms <= 0:
            raise ValueError(f"the TTFA SLO must be > 0 ms, got {self.ttfa_p95_ms}")

    def misses(self, level: Level) -> list[str]:
        """Why ``level`` misses the SLO (empty: it meets it)."""
        why = []
        if level.failed:
            why.append(f"{level.failed} failed ({level.refused} refused)")
        if level.underrun_requests:
            why.append(f"{level.underrun_requests} streams underran")
        p95 = level.ttfa_ms.get("p95")
        if p95 is None or p95 > self.ttfa_p95_ms:
            why.append(f"TTFA p95 {'-' if p95 is None else format(p95, '.0f')} ms > {self.ttfa_p95_ms:.0f}")
        return why


def capacity(levels: list[Level], slo: Slo, all_rates: bool = False) -> dict[str, object]:
    """The capacity search's record: every rate tried (ascending) with its verdict per arrival seed, and the
    capacity: the highest rate met before the first one missed (None when the lowest already missed). A rate
    is met only when every seed's run of it meets the SLO. Rates after the first miss are listed only with
    ``all_rates`` (a fixed list measured whole); they never raise the capacity."""
    by_rate: dict[float, list[Level]] = {}
    for lv in levels:
        if lv.rate is not None:
            by_rate.setdefault(lv.rate, []).append(lv)
    rows: list[dict[str, object]] = []
    best, missed = None, False
    for rate in sorted(by_rate):
        row = rate_verdict(rate, sorted(by_rate[rate], key=lambda lv: lv.seed or 0), slo)
        rows.append(row)
        missed = missed or not row["met"]
        if not missed:
            best = rate
        elif not all_rates:
            break
    return {"slo_ttfa_p95_ms": slo.ttfa_p95_ms, "rates": rows, "capacity_rate": best}


def rate_verdict(rate: float, runs: list[Level], slo: Slo) -> dict[str, object]:
    """One rate's row: met only when every seed's run met the SLO; each seed's verdict beside it."""
    why = {lv.seed: slo.misses(lv) for lv in runs}
    several = len(runs) > 1
    misses = [f"seed {lv.seed}: {m}" if several else m for lv in runs for m in why[lv.seed]]
    seeds = [
        {"seed": lv.seed, "requests": lv.requests, "ttfa_p95_ms": lv.ttfa_ms.get("p95"),
         "met": not why[lv.seed], "misses": why[lv.seed]}
        for lv in runs
    ]  # fmt: skip
    return {
        "rate": rate, "requests": sum(lv.requests for lv in runs), "met": not misses, "misses": misses,
        "seeds": seeds,
    }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OpenLoop:
    """One open-loop level: ``requests`` arrivals at ``rate`` per second, lengths spread around the
    workload's ``tokens``."""

    rate: float
    requests: int
    spread: float = 0.5

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.requests < 1:
            raise ValueError(f"need rate > 0 and requests >= 1, got {self.rate} and {self.requests}")
        if not 0.0 <= self.spread < 1.0:
            raise ValueError(f"spread must be within [0, 1), got {self.spread}")

    def arrivals(self, rng: random.Random) -> list[float]:
        """Send times (s from the level's start): cumulative exponential gaps; the first at 0."""
        times, t = [], 0.0
        for _ in range(self.requests):
            times.append(t)
            t += rng.expovariate(self.rate)
        return times

    def lengths(self, tokens: int, rng: random.Random) -> list[int]:
        """Speech tokens per request, uniform over the spread (at least 1)."""
        lo, hi = max(1, round(tokens * (1 - self.spread))), max(1, round(tokens * (1 + self.spread)))
        return [rng.randint(lo, hi) for _ in range(self.requests)]


def active_streams(intervals: list[tuple[float, float]], wall_s: float) -> tuple[float, int]:
    """(time-weighted mean, max) of how many [start, end) intervals overlap over ``wall_s`` seconds."""
    if not intervals or wall_s <= 0:
        return 0.0, 0
    busy = sum(end - start for start, end in intervals)
    edges = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1])
    )
    now = most = 0
    for _, step in edges:  # ends sort before starts at the same instant: touching intervals do not overlap
        now += step
        most = max(most, now)
    return busy / wall_s, most


def windows(sent: list[tuple[float, RequestResult]], span_s: float, window_s: float) -> list[Window]:
    """The level cut by arrival time into ``window_s`` stretches, as many as fit the nominal ``span_s`` of
    arrivals, rounded (at least one; the last runs to the span's end or the last arrival, whichever is later);
    ``sent``: (send s, result)."""
    count = max(1, round(span_s / window_s))
    last = max((s for s, _ in sent), default=0.0)
    spans = [(s, s + r.total_ms / 1000.0) for s, r in sent]
    out = []
    for k in range(count):
        start, end = k * window_s, (k + 1) * window_s
        final = k == count - 1
        end = max(span_s, last) if final else end
        here = [r for s, r in sent if start <= s and (s < end or final)]
        ttfa = [r.ttfa_ms for r in here if r.ok and r.ttfa_ms is not None]
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)
        out.append(
            Window(
                start_s=start, end_s=end, requests=len(here), failed=sum(not r.ok for r in here),
                underrun_requests=sum(1 for r in here if r.ok and r.underruns),
                ttfa_p50_ms=percentile(ttfa, 50), ttfa_p95_ms=percentile(ttfa, 95),
                active_mean=busy / (end - start) if end > start else 0.0,
            )
        )  # fmt: skip
    return out


async def run_open_level(
    target: Target,
    workload: Workload,
    load: OpenLoop,
    prompt: np.ndarray | tuple[np.ndarray, ...],
    seed: int = 0,
    window_s: float = 30.0,
) -> Level:
    """Send every request at its arrival time (arrivals and lengths drawn from ``seed``; request i's
    synthesis seed ``seed + i``, its prompt the (i mod n)-th of a tuple of n), wait for all of them; TTFA
    also per ``window_s`` of arrivals."""
    prompts = prompt if isinstance(prompt, tuple) else (prompt,)
    rng = random.Random(seed)
    sends, lengths = load.arrivals(rng), load.lengths(workload.tokens, rng)
    target.reset_peak_memory()
    before = await target.server_ttfa()
    t0 = time.perf_counter()

    async def send(i: int) -> tuple[float, RequestResult]:
        await asyncio.sleep(max(0.0, t0 + sends[i] - time.perf_counter()))  # the schedule, not a poll
        sent = time.perf_counter() - t0
        req = dataclasses.replace(workload, tokens=lengths[i]).request(seed + i, prompts[i % len(prompts)])
        return sent, await one_request(target, req, i)

    done = await asyncio.gather(*(send(i) for i in range(load.requests)))
    wall = time.perf_counter() - t0
    mode = "stream" if workload.stream else "offline"
    results = [r for _, r in done]
    mean, most = active_streams([(s, s + r.total_ms / 1000.0) for s, r in done], wall)
    level = summarize(target, f"{mode} open-loop", most, results, wall)
    server = server_mean_ms(before, await target.server_ttfa())
    span = load.requests / load.rate  # the nominal arrival span (s): rate x span requests
    return dataclasses.replace(
        level, rate=load.rate, active_mean=mean, active_max=most, server_ttfa_ms_mean=server, seed=seed,
        arrival_s=span, windows=windows(list(done), span, window_s),
    )  # fmt: skip
