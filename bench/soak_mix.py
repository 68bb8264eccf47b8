"""What the open-loop soak sends: the arrival schedule with each request's kind (a good stream, a stream in a
saved voice, a client that leaves mid-stream, a bad request), the bad requests with the error each must get,
and the three clients that send them to an in-process ``TTSEngine`` and report an ``Outcome``.

Arrivals and lengths come from ``bench.open_loop.OpenLoop`` (Poisson gaps, lengths uniform over
tokens x [1 - spread, 1 + spread]); the client-side clock and underrun accounting from ``bench.load``.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bench.load import (
    REFUSED,
    SAMPLE_RATE,
    TEXT,
    EngineTarget,
    Recorder,
    RequestResult,
    Workload,
    one_request,
)
from bench.open_loop import OpenLoop
from engine.errors import Busy, InvalidInput, NotFound, TooLarge
from engine.request import Mode, SynthesisRequest

GOOD, VOICE, LEAVER, BAD = "good", "voice", "leaver", "bad"
TOKENS_PER_S = 25.0  # speech tokens per second of audio


@dataclass(frozen=True)
class MixConfig:
    """The open-loop soak's load: ``rate`` arrivals/s for ``minutes``, requests of ``tokens`` +- ``spread``;
    ``leave_fraction`` of them are clients that stop reading mid-stream, ``bad_fraction`` bad requests,
    and ``voice_fraction`` of the good ones name a saved voice instead of sending prompt audio."""

    rate: float
    minutes: float
    tokens: int = 250
    spread: float = 0.5
    leave_fraction: float = 0.10
    bad_fraction: float = 0.05
    voice_fraction: float = 0.05
    seed: int = 0
    mode: Mode = Mode.ZERO_SHOT

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.minutes <= 0 or self.tokens < 1:
            raise ValueError(f"need rate > 0, minutes > 0, tokens >= 1; got {self.rate}, {self.minutes}")
        shares = (self.leave_fraction, self.bad_fraction, self.voice_fraction)
        if not all(0.0 <= s <= 1.0 for s in shares) or self.leave_fraction + self.bad_fraction > 1.0:
            raise ValueError(f"fractions must be within [0, 1] and leave + bad <= 1, got {shares}")
        OpenLoop(self.rate, 1, self.spread)  # checks the spread

    @property
    def requests(self) -> int:
        return max(1, round(self.rate * self.minutes * 60.0))


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule: when it is sent (s after the start), its length and what it is.
    ``case``: the bad request's ``BadCase`` name; ``leave_at``: the share of its audio a leaver reads."""

    index: int
    at_s: float
    tokens: int
    kind: str
    case: str = ""
    leave_at: float = 0.0


@dataclass(frozen=True)
class BadCase:
    """A request the engine must refuse, and the error type it must refuse it with (the engine's
    ``engine.errors`` types; a speed out of range is refused by ``SynthesisRequest`` itself)."""

    name: str
    expected: type[Exception]
    build: Callable[[np.ndarray], SynthesisRequest]


def _cloned(prompt: np.ndarray, text: str = TEXT, **kw: Any) -> SynthesisRequest:
    """A zero-shot request that would be good but for what ``kw`` or the arguments change."""
    return SynthesisRequest(
        text=text, prompt_audio=(prompt, SAMPLE_RATE), prompt_text="a prompt", forced_tokens=25, **kw
    )


BAD_CASES = (
    BadCase("empty text", InvalidInput, lambda p: _cloned(p, " \n\t ")),
    BadCase("control characters", InvalidInput, lambda p: _cloned(p, "Hello\x07 there")),
    BadCase("nothing speakable", InvalidInput, lambda p: _cloned(p, "\u200b\u0301\u0301\u200d")),
    BadCase("text too long", TooLarge, lambda p: _cloned(p, "word " * 20_000)),  # 100k chars
    BadCase("prompt too short", InvalidInput, lambda p: _cloned(p[: SAMPLE_RATE // 4])),  # 0.25 s
    BadCase("prompt too long", TooLarge, lambda p: _cloned(np.tile(p, 1 + int(31 * SAMPLE_RATE / p.size)))),
    BadCase(
        "unknown voice",
        NotFound,
        lambda p: SynthesisRequest(text=TEXT, voice_id="soak-no-such-voice", forced_tokens=25),
    ),
    BadCase("bad speed", ValueError, lambda p: _cloned(p, speed=3.0)),
)
CASES = {c.name: c for c in BAD_CASES}


def schedule(cfg: MixConfig) -> list[Arrival]:
    """Every arrival of the run, seeded: Poisson send times, spread lengths, then each one's kind."""
    rng = random.Random(cfg.seed)
    load = OpenLoop(cfg.rate, cfg.requests, cfg.spread)
    times, lengths = load.arrivals(rng), load.lengths(cfg.tokens, rng)
    return [
        _kind(cfg, rng, Arrival(i, t, n, GOOD)) for i, (t, n) in enumerate(zip(times, lengths, strict=True))
    ]


def _kind(cfg: MixConfig, rng: random.Random, arrival: Arrival) -> Arrival:
    draw = rng.random()
    if draw < cfg.bad_fraction:
        return replace(arrival, kind=BAD, case=rng.choice(BAD_CASES).name)
    if draw < cfg.bad_fraction + cfg.leave_fraction:  # it leaves after 10-90 % of its audio
        return replace(arrival, kind=LEAVER, leave_at=rng.uniform(0.1, 0.9))
    return replace(arrival, kind=VOICE if rng.random() < cfg.voice_fraction else GOOD)


# ----------------------------------------------------------------------------------------------- clients


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it. ``error``: "Type: message" when it raised; ``refused``: by
    admission (Busy), never started; ``as_expected`` (bad requests): refused with the case's error type;
    ``freed`` (leavers that left): the engine no longer held the stream once the client closed it."""

    index: int
    kind: str
    case: str
    start_s: float
    tokens: int
    ttfa_ms: float | None
    audio_s: float
    underruns: int
    error: str | None = None
    refused: bool = False
    as_expected: bool | None = None
    freed: bool | None = None


@dataclass(frozen=True)
class Client:
    """What every client shares: the engine, the stand-in prompt, the saved voices and their owner, and
    the run's start on ``time.monotonic``."""

    engine: Any
    prompt: np.ndarray
    voices: tuple[str, ...]
    owner: str
    t0: float
    mode: Mode = Mode.ZERO_SHOT

    def request(self, arrival: Arrival) -> SynthesisRequest:
        """The good request of ``arrival`` (prompt audio, or a saved voice for the ``voice`` kind)."""
        if arrival.kind != VOICE:
            return Workload(tokens=arrival.tokens, mode=self.mode).request(arrival.index, self.prompt)
        voice = self.voices[arrival.index % len(self.voices)]
        return SynthesisRequest(
            text=TEXT,
            voice_id=voice,
            voice_owner=self.owner,
            seed=arrival.index,
            forced_tokens=arrival.tokens,
        )

    def outcome(self, arrival: Arrival, result: RequestResult, started: float, **kw: Any) -> Outcome:
        refused = result.error is not None and result.error.startswith(REFUSED)
        return Outcome(
            arrival.index, arrival.kind, arrival.case, started - self.t0, arrival.tokens, result.ttfa_ms,
            result.audio_s, result.underruns, result.error, refused, **kw,
        )  # fmt: skip


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


async def send_good(client: Client, arrival: Arrival) -> Outcome:
    """A client that reads its whole stream (``bench.load.one_request``: TTFA and underruns)."""
    started = time.monotonic()
    result = await one_request(EngineTarget(client.engine), client.request(arrival), arrival.index)
    return client.outcome(arrival, result, started)


async def send_leaver(client: Client, arrival: Arrival) -> Outcome:
    """A client that closes its stream once it has ``leave_at`` of its audio, as a server closes the
    stream of a client that disconnected; then asks the engine to abort it, which finds nothing when the
    close freed it."""
    req, rec, started = client.request(arrival), Recorder(), time.monotonic()
    stop_s, heard, left, error = arrival.leave_at * arrival.tokens / TOKENS_PER_S, 0.0, False, None
    try:
        async with contextlib.aclosing(client.engine.stream(req)) as chunks:
            async for chunk in chunks:
                rec.chunk(chunk.seconds)
                heard += chunk.seconds
                if heard >= stop_s and not chunk.is_last:
                    left = True
                    break
    except Exception as err:  # counted: a leaver is a good client until it leaves
        error = _error(err)
    freed = not client.engine.abort(req.request_id) if left else None
    return client.outcome(arrival, rec.result(arrival.index, error), started, freed=freed)


async def send_bad(client: Client, arrival: Arrival) -> Outcome:
    """A bad request: it must raise its case's error type (Busy counts apart: refused before the check)."""
    case, started = CASES[arrival.case], time.monotonic()
    rec, error, expected, refused = Recorder(), None, False, False
    try:
        async for chunk in client.engine.stream(case.build(client.prompt)):
            rec.chunk(chunk.seconds)
    except Exception as err:  # the point of a bad request: which error it got
        error, expected, refused = _error(err), isinstance(err, case.expected), isinstance(err, Busy)
    outcome = client.outcome(arrival, rec.result(arrival.index, error), started, as_expected=expected)
    return replace(outcome, refused=refused)


SENDERS = {GOOD: send_good, VOICE: send_good, LEAVER: send_leaver, BAD: send_bad}


async def send(client: Client, arrival: Arrival) -> Outcome:
    return await SENDERS[arrival.kind](client, arrival)
