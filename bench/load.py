"""The load generator: fixed-length requests at a fixed concurrency, timed from the client's side.

A *target* runs one ``SynthesisRequest`` and reports what it sees to a ``Recorder``: when the request left
the queue and when each piece of audio arrived. Targets: ``EngineTarget`` (``TTSEngine.stream``
in-process), ``HttpTarget`` (``POST /v1/audio/speech`` streaming raw pcm) and, in ``bench.baseline``, the
reference-style path. ``run_level`` drives one target closed-loop: ``concurrency`` workers each send their
next request as soon as the previous one ends, until ``requests`` are done (``bench.open_loop``: arrivals
at a rate instead).

Definitions (all measured by the client; seconds of audio at 24 kHz):
- queue wait: submit -> the request starts computing (engine metrics; the X-Queue-Wait-Ms header over HTTP);
- TTFA: submit -> first non-empty audio arrives (includes the queue wait); with ``text_wps`` (text-streaming
  input) the first word is sent at submit, so this is the TTFA from the first text piece;
- RTF: (last audio arrival - submit) / audio seconds: what the client waits per second of audio, queue
  included (the engine's own ``RequestMetrics.rtf`` leaves the queue out; with as many engine slots as
  streams, as the bench sets them, the two agree);
- underrun: a player starts at the first chunk's arrival and plays without gaps; a chunk is late when it
  arrives after everything delivered before it has finished playing; the player then stalls until the chunk
  arrives (the stall adds to underrun seconds) and resumes from there.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import logging
import math
import resource
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engine.request import Mode, SynthesisRequest
from engine.serving.metrics import TTFA_PARTS

log = logging.getLogger(__name__)

SAMPLE_RATE = 24000
# One sentence so the text frontend makes exactly one segment: forced_tokens then fixes the whole length.
TEXT = "CosyStream measures streaming speech synthesis at a fixed length"
TRANSCRIPT = "This is the transcript of the prompt voice"


def prompt_audio(seconds: float = 3.5, sr: int = SAMPLE_RATE, f0: float = 130.0) -> np.ndarray:
    """A voiced stand-in prompt, float32 mono: 6 harmonics of a gliding f0 under a 4 Hz syllable envelope."""
    t = np.arange(int(seconds * sr)) / sr
    pitch = f0 * (1.0 + 0.06 * np.sin(2 * np.pi * 0.5 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sr
    voice = sum(np.sin(k * phase) / k for k in range(1, 7))
    syllables = np.sin(np.pi * 4.0 * t) ** 2  # 4 syllables/s, silent between them
    noise = np.random.default_rng(0).standard_normal(t.size)
    return (0.25 * voice * syllables + 0.005 * noise).astype(np.float32)


# --prompt-spread: voices whose lengths step one speech token (40 ms at 25 tokens/s) through one 25-token
# chunk of the flow's grid. The first chunk ends on that grid (the reference's: hop + pad tokens, pad the
# tokens from the prompt's end to the next grid line), and the fast start splits it only where pad >=
# StreamConfig.min_first_hop, so the one 3.5-s prompt (pad 13) always splits where a random visitor's
# prompt does about half the time. Their f0s differ too: a voice each.
PROMPT_SPREAD = tuple(3.5 + 0.04 * k for k in range(25))  # s


def prompt_set(spread: bool = False) -> tuple[np.ndarray, ...]:
    """The open loop's prompts (request i clones the (i mod n)-th): the bench's one prompt, or with
    ``spread`` one per length of ``PROMPT_SPREAD``."""
    if not spread:
        return (prompt_audio(),)
    return tuple(prompt_audio(seconds, f0=100.0 + 4.0 * k) for k, seconds in enumerate(PROMPT_SPREAD))


@dataclass(frozen=True)
class Workload:
    """What every request of a run asks for; ``tokens`` speech tokens = tokens / 25 s of audio."""

    tokens: int = 250
    stream: bool = True
    mode: Mode = Mode.ZERO_SHOT
    text: str = TEXT
    transcript: str = TRANSCRIPT
    text_wps: float | None = None  # text-streaming input: the words arrive at this many per second

    def __post_init__(self) -> None:
        if self.text_wps is not None and not 0 < self.text_wps <= 1000:
            raise ValueError(f"text_wps must be within (0, 1000], got {self.text_wps}")

    def request(self, seed: int, prompt: np.ndarray) -> SynthesisRequest:
        live = self.text_wps is not None
        return SynthesisRequest(
            text="" if live else self.text,
            mode=self.mode,
            prompt_audio=(prompt, SAMPLE_RATE),
            prompt_text=self.transcript,
            stream=self.stream,
            seed=seed,
            forced_tokens=self.tokens,
            text_stream=paced_words(self.live_words(), self.text_wps) if self.text_wps else None,
        )

    def live_words(self) -> list[str]:
        """The streamed text: the sentence's words repeated to 1 word per 10 speech tokens (at least 5),
        about the speaking rate, so the text paces the streaming phase and the forced length the rest."""
        words = self.text.split()
        n = max(5, self.tokens // 10)
        return [words[i % len(words)] for i in range(n)]


async def paced_words(words: Sequence[str], wps: float) -> AsyncIterator[str]:
    """Word i at i / wps seconds after the first is asked for (an LLM writing at a steady rate)."""
    t0 = time.perf_counter()
    for i, word in enumerate(words):
        await asyncio.sleep(max(0.0, t0 + i / wps - time.perf_counter()))
        yield word if i == 0 else " " + word


# --------------------------------------------------------------------------------------------- math


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/mean/max of a sample (None everywhere when it is empty)."""
    return {
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
        "max": max(values) if values else None,
    }


def underruns(arrivals: Sequence[tuple[float, float]]) -> tuple[int, float]:
    """(late chunks, stalled seconds) for arrivals [(arrival s, audio s)] in arrival order.

    The player starts with the first non-empty chunk; ``played_until`` is when the audio delivered so far
    finishes playing. A chunk arriving later than that is an underrun: playback stalls until it arrives.
    """
    played_until: float | None = None
    count, stalled = 0, 0.0
    for t, seconds in arrivals:
        if seconds <= 0:
            continue  # the end-of-stream marker carries no audio
        if played_until is None:
            played_until = t
        elif t > played_until:
            count, stalled, played_until = count + 1, stalled + t - played_until, t
        played_until += seconds
    return count, stalled


# ----------------------------------------------------------------------------------------- recording


# how a refusal by the server's admission reads in ``RequestResult.error``: in process, over HTTP
REFUSED = ("Busy:", "RuntimeError: HTTP 429")


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times in ms, audio in s; ``error`` set when it failed."""

    index: int
    error: str | None
    queue_wait_ms: float | None
    ttfa_ms: float | None
    rtf: float | None
    audio_s: float
    total_ms: float
    chunks: int
    underruns: int
    underrun_s: float
    stage_ms: dict[str, float] = field(default_factory=dict)
    # engine.serving.metrics.TTFA_PARTS, in-process
    ttfa_parts_ms: dict[str, float] = field(default_factory=dict)
    # in process: every chunk's engine.serving.metrics.ChunkTrace row (bench --trace writes them to
    # trace.jsonl)
    trace: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


class Recorder:
    """The client-side clock of one request; ``chunk`` may be called from another thread."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.t_submit = clock()
        self.queue_wait_s: float | None = None
        self.arrivals: list[tuple[float, float]] = []  # (s since submit, audio s)
        self.stage_ms: dict[str, float] = {}
        self.ttfa_parts_ms: dict[str, float] = {}
        self.trace: list[dict[str, Any]] = []

    def started(self, queue_wait_s: float | None = None) -> None:
        """The request began computing ``queue_wait_s`` after submit (default: now)."""
        if self.queue_wait_s is None:
            self.queue_wait_s = self._clock() - self.t_submit if queue_wait_s is None else queue_wait_s

    def chunk(self, seconds: float) -> None:
        self.arrivals.append((self._clock() - self.t_submit, seconds))

    def result(self, index: int, error: str | None = None) -> RequestResult:
        audio = [(t, s) for t, s in self.arrivals if s > 0]
        audio_s = sum(s for _, s in audio)
        end = audio[-1][0] if audio else self._clock() - self.t_submit
        count, stalled = underruns(audio)
        return RequestResult(
            index=index,
            error=error,
            queue_wait_ms=None if self.queue_wait_s is None else self.queue_wait_s * 1000.0,
            ttfa_ms=audio[0][0] * 1000.0 if audio else None,
            rtf=end / audio_s if audio_s > 0 else None,
            audio_s=audio_s,
            total_ms=end * 1000.0,
            chunks=len(audio),
            underruns=count,
            underrun_s=stalled,
            stage_ms=dict(self.stage_ms),
            ttfa_parts_ms=dict(self.ttfa_parts_ms),
            trace=list(self.trace),
        )


# -------------------------------------------------------------------------------------------- targets


class Target(Protocol):
    name: str

    async def run(self, req: SynthesisRequest, rec: Recorder) -> None: ...

    def peak_memory_mb(self) -> float | None: ...

    def reset_peak_memory(self) -> None: ...

    async def server_ttfa(self) -> tuple[float, int] | None:
        """The server's own TTFA totals so far (seconds summed, requests), where it reports them."""
        ...


class EngineTarget:
    """``TTSEngine.stream`` in this process (the engine's own queue and batching)."""

    name = "cosystream"

    def __init__(self, engine: Any):
        self.engine = engine

    async def run(self, req: SynthesisRequest, rec: Recorder) -> None:
        async for chunk in self.engine.stream(req):
            rec.started(chunk.metrics.queue_wait_ms / 1000.0)
            rec.chunk(chunk.seconds)
            if chunk.trace is not None:
                rec.trace.append(chunk.trace.row())
            if chunk.is_last:
                rec.stage_ms = dict(chunk.metrics.stage_ms)
                rec.ttfa_parts_ms = dict(chunk.metrics.ttfa_parts_ms)

    def peak_memory_mb(self) -> float | None:
        from engine import device as devices

        return devices.peak_memory_mb(self.engine.model.device)

    def reset_peak_memory(self) -> None:
        from engine import device as devices

        devices.reset_peak_memory(self.engine.model.device)

    async def server_ttfa(self) -> tuple[float, int] | None:
        return None  # in process, the request's own TTFA parts say where its time went


def wav_base64(samples: np.ndarray, sr: int = SAMPLE_RATE) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode("ascii")


class HttpTarget:
    """``POST {url}/v1/audio/speech`` with ``response_format=pcm`` (s16le), timed per received piece.

    ``forced_tokens`` is sent as an extension field; a server that ignores it synthesises the text's own
    length, which the results show as a different ``audio_s``. ``sse``: the audio comes as SSE events
    (base64 deltas), and the last event's metrics give each result the server's TTFA parts and stages.
    """

    name = "cosystream-http"

    def __init__(self, url: str, max_connections: int, api_key: str | None = None, sse: bool = False):
        import httpx

        self.sse = sse
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.url = url.rstrip("/") + "/v1/audio/speech"
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0), headers=headers)
        self._prompt_b64: tuple[np.ndarray, str] | None = None  # the last prompt sent, and its wav

    def body(self, req: SynthesisRequest) -> dict[str, Any]:
        assert req.prompt_audio is not None, "the bench always sends its prompt audio"
        samples, sr = req.prompt_audio
        if self._prompt_b64 is None or self._prompt_b64[0] is not samples:  # the array itself, held: an
            self._prompt_b64 = (samples, wav_base64(samples, sr))  # id() alone is reused once it is freed
        return {
            "input": req.text,
            "mode": str(req.mode),
            "ref_audio": self._prompt_b64[1],
            "ref_text": req.prompt_text,
            "response_format": "pcm",
            "stream": req.stream,
            "seed": req.seed,
            "forced_tokens": req.forced_tokens,
        } | ({"stream_format": "sse"} if self.sse else {})

    async def run(self, req: SynthesisRequest, rec: Recorder) -> None:
        async with self.client.stream("POST", self.url, json=self.body(req)) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
            wait_ms = resp.headers.get("X-Queue-Wait-Ms")
            rec.started(float(wait_ms) / 1000.0 if wait_ms is not None else None)
            rate = int(resp.headers.get("X-Sample-Rate", SAMPLE_RATE))
            if self.sse:
                await read_events(resp.aiter_lines(), rec, rate)
                return
            async for data in resp.aiter_raw():
                rec.chunk(len(data) / 2 / rate)  # s16le mono: 2 bytes a sample

    def peak_memory_mb(self) -> float | None:
        return None  # the server's device is not visible from here

    def reset_peak_memory(self) -> None:
        """Nothing to reset: the server's device is not visible from here."""

    async def server_ttfa(self) -> tuple[float, int] | None:
        """``cosystream_ttfa_seconds`` (sum, count) from the server's /metrics: the level's mean over these
        is the TTFA the engine saw; the client's mean minus it is what HTTP (and an ingress) added."""
        from prometheus_client.parser import text_string_to_metric_families

        resp = await self.client.get(self.url.removesuffix("/v1/audio/speech") + "/metrics")
        resp.raise_for_status()
        sums = {"cosystream_ttfa_seconds_sum": 0.0, "cosystream_ttfa_seconds_count": 0.0}
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
        return sums["cosystream_ttfa_seconds_sum"], int(sums["cosystream_ttfa_seconds_count"])

    async def aclose(self) -> None:
        await self.client.aclose()


async def read_events(lines: AsyncIterator[str], rec: Recorder, rate: int) -> None:
    """The speech API's SSE stream: each ``speech.audio.delta`` (base64 s16le) timed as it arrives, the
    ``speech.audio.done`` event's metrics (the server's TTFA parts and stage times) onto ``rec``; an
    ``error`` event (a failure after the status line) fails the request."""
    done = False
    async for line in lines:
        if not line.startswith("data: "):
            continue
        event = json.loads(line.removeprefix("data: "))
        if event.get("type") == "speech.audio.delta":
            rec.chunk(len(base64.b64decode(event["audio"])) / 2 / rate)
        elif event.get("type") == "speech.audio.done":
            metrics, done = event.get("metrics") or {}, True
            rec.ttfa_parts_ms = dict(metrics.get("ttfa_parts_ms") or {})
            rec.stage_ms = dict(metrics.get("stage_ms") or {})
        elif event.get("type") == "error":
            raise RuntimeError(f"the stream ended with an error event: {event.get('error', event)}")
    if not done:
        raise RuntimeError("the event stream ended without its speech.audio.done event")


# ------------------------------------------------------------------------------------------ one level


@dataclass(frozen=True)
class Window:
    """One stretch of an open-loop level's arrivals (``bench.open_loop.windows``): the requests sent in
    [start_s, end_s) after the level's start, their TTFA (ms; None when none succeeded) and how many streams
    were active over it (time-weighted mean). A steady state shows flat windows; a queue that builds up,
    rising ones."""

    start_s: float
    end_s: float
    requests: int
    failed: int
    underrun_requests: int
    ttfa_p50_ms: float | None
    ttfa_p95_ms: float | None
    active_mean: float


@dataclass(frozen=True)
class Level:
    """One (system, mode, concurrency) run: its distributions and totals; JSON-ready via ``asdict``."""

    system: str
    mode: str
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    audio_s: float
    audio_s_per_s: float
    ttfa_ms: dict[str, float | None]
    rtf: dict[str, float | None]
    queue_wait_ms: dict[str, float | None]
    underrun_requests: int
    underruns: int
    underrun_s: float
    peak_device_memory_mb: float | None
    host_peak_rss_mb: float
    stage_ms_mean: dict[str, float]
    ttfa_parts_ms_mean: dict[str, float]  # where the TTFA went (in-process engine only), mean per request
    errors: list[str]
    per_request: list[RequestResult]
    # over HTTP: the server's mean TTFA for this level's requests, from its /metrics (None in process)
    server_ttfa_ms_mean: float | None = None
    # open loop (bench.open_loop): arrivals per second, and the streams active (time-weighted mean, max)
    rate: float | None = None
    active_mean: float | None = None
    active_max: int | None = None
    refused: int = 0  # of ``failed``: refused by the server's admission (Busy / 429), never started
    seed: int | None = None  # open loop: the seed of the arrivals and lengths (request i: seed + i)
    arrival_s: float | None = None  # open loop: the arrivals' nominal span, requests / rate (s)
    windows: list[Window] = field(default_factory=list)  # open loop: TTFA per stretch of arrivals


async def one_request(target: Target, req: SynthesisRequest, index: int) -> RequestResult:
    rec = Recorder()
    try:
        await target.run(req, rec)
    except Exception as err:  # a failed request is a data point, not the end of the run
        log.warning("request %d failed: %s: %s", index, type(err).__name__, err)
        return rec.result(index, f"{type(err).__name__}: {err}")
    return rec.result(index)


async def run_level(
    target: Target, workload: Workload, concurrency: int, requests: int, prompt: np.ndarray, seed: int = 0
) -> Level:
    """``requests`` requests through ``concurrency`` closed-loop workers; request i uses seed ``seed + i``."""
    if concurrency < 1 or requests < 1:
        raise ValueError(f"need concurrency >= 1 and requests >= 1, got {concurrency} and {requests}")
    target.reset_peak_memory()  # the level's own peak, not an earlier level's or the model load's
    before = await target.server_ttfa()
    pending = iter(range(requests))  # shared by the workers: each takes the next index when it is free
    results: list[RequestResult] = []

    async def worker() -> None:
        for i in pending:
            results.append(await one_request(target, workload.request(seed + i, prompt), i))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    mode = "stream" if workload.stream else "offline"
    level = summarize(target, mode, concurrency, sorted(results, key=lambda r: r.index), wall)
    return dataclasses.replace(level, server_ttfa_ms_mean=server_mean_ms(before, await target.server_ttfa()))


def server_mean_ms(before: tuple[float, int] | None, after: tuple[float, int] | None) -> float | None:
    """Mean server TTFA (ms) of the requests between two /metrics readings; None where none came."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1000.0


def summarize(
    target: Target, mode: str, concurrency: int, results: list[RequestResult], wall_s: float
) -> Level:
    ok = [r for r in results if r.ok]
    audio = sum(r.audio_s for r in ok)
    stages = sorted({k for r in ok for k in r.stage_ms})
    return Level(
        system=target.name,
        mode=mode,
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(ok),
        wall_s=wall_s,
        audio_s=audio,
        audio_s_per_s=audio / wall_s if wall_s > 0 else 0.0,
        ttfa_ms=distribution([r.ttfa_ms for r in ok if r.ttfa_ms is not None]),
        rtf=distribution([r.rtf for r in ok if r.rtf is not None]),
        queue_wait_ms=distribution([r.queue_wait_ms for r in ok if r.queue_wait_ms is not None]),
        underrun_requests=sum(1 for r in ok if r.underruns),
        underruns=sum(r.underruns for r in ok),
        underrun_s=sum(r.underrun_s for r in ok),
        peak_device_memory_mb=target.peak_memory_mb(),
        host_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,  # Linux: KiB
        stage_ms_mean={k: sum(r.stage_ms.get(k, 0.0) for r in ok) / len(ok) for k in stages},
        ttfa_parts_ms_mean=_mean_parts([r.ttfa_parts_ms for r in ok]),
        errors=sorted({r.error for r in results if r.error is not None}),
        refused=sum(1 for r in results if r.error is not None and r.error.startswith(REFUSED)),
        per_request=results,
    )


def _mean_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each TTFA part over the requests that report all of them (in engine order)."""
    full = [p for p in parts if set(p) == set(TTFA_PARTS)]
    return {k: sum(p[k] for p in full) / len(full) for k in TTFA_PARTS} if full else {}
