"""A bounded load test: the whole app (``create_app``: API + UI) on uvicorn at 127.0.0.1 over a real tiny
engine (4 streams compute, 4 wait), 16 concurrent httpx clients sending 48 requests that mix chunked
streams, SSE streams, whole files and streams cancelled after the first bytes.

Refused requests (429 with ``Retry-After``) are retried after the delay the server asks for; nothing else
may fail. Every accepted request completes with valid audio, and at the end nothing is left running (engine
slots, queue, LM sequences, token2wav jobs) and the process RSS grew by a bounded amount.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from bench.memory import rss_mb
from server.web import create_app
from tests.api.support import live_server
from tests.conftest import WAIT_S
from tests.reliability.support import (
    LIMITS,
    TEXT,
    Bounded,
    check_pcm,
    good_wav,
    idle_state,
    wait_idle,
)

log = logging.getLogger(__name__)

CLIENTS, PER_CLIENT = 16, 3  # 48 requests
KINDS = ("stream", "sse", "whole", "cancel")
TOKENS = 40  # speech tokens per request: 1.6 s of audio
# the whole load's ceiling, and each request's for its 429 retries (each waits Retry-After, 1 s): the
# queue drains at the machine's speed, so a busy machine refuses a request more times, not wrongly
DEADLINE_S = 4 * WAIT_S
# Measured +15-18 MiB (allocator caches, warm thread pools). This catches leaks of >= ~1.3 MiB a request
# (a KV cache, a mel buffer); smaller ones hide in the noise (leaked requests themselves are caught
# exactly by the counters checked at the end).
RSS_GROWTH_MB = 64.0


@dataclass
class Tally:
    """What the clients saw, for the assertions and the logged figures."""

    done: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    errors: list[str] = field(default_factory=list)
    ttfa_ms: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def server(engine) -> Iterator[str]:
    app = create_app(Bounded(engine, TOKENS), ui_lang="en", limits=LIMITS, api_key="", random_weights=True)
    with live_server(app) as url:
        yield url


def speech_body(kind: str, voice: str, ref: str, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"input": TEXT, "mode": "cross_lingual", "seed": seed}
    if kind == "whole":  # whole files upload their prompt; the others use the saved voice
        return body | {"ref_audio": ref, "stream": False, "response_format": "wav"}
    body |= {"voice": voice, "mode": "zero_shot", "stream": True, "response_format": "pcm"}
    return body | ({"stream_format": "sse"} if kind == "sse" else {})


async def read_audio(kind: str, r: httpx.Response) -> np.ndarray | None:
    """The response's audio as float32 (None for a stream the client hung up on)."""
    if kind == "cancel":
        async for data in r.aiter_bytes():
            assert data
            return None
        raise AssertionError("the stream to cancel sent nothing")
    raw = await r.aread()
    if kind == "whole":
        return sf.read(io.BytesIO(raw), dtype="float32")[0]
    if kind == "sse":
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        raw = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(raw) % 2 == 0
    return np.frombuffer(raw, np.int16).astype(np.float32) / 32768


async def one_request(client: httpx.AsyncClient, body: dict[str, Any], kind: str, tally: Tally) -> None:
    """Send until accepted (429s wait Retry-After), then check what came back."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            if r.status_code == 429:
                await r.aread()
                assert r.json()["error"]["code"] == "queue_full", r.text
                tally.refused += 1
                await asyncio.sleep(float(r.headers["retry-after"]))
                continue
            if r.status_code != 200:
                tally.errors.append(f"{kind}: {r.status_code} {(await r.aread())[:200]!r}")
                return
            tally.request_ids.append(r.headers["x-request-id"])
            tally.ttfa_ms.append(float(r.headers["x-ttfa-ms"]))
            pcm = await read_audio(kind, r)
        if pcm is not None:
            check_pcm(pcm)
            tally.latency_s.append(time.perf_counter() - t0)
        tally.done[kind] += 1
        return
    tally.errors.append(f"{kind}: still refused after {DEADLINE_S:.0f} s")


async def client_run(url: str, index: int, voice: str, ref: str, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
        for j in range(PER_CLIENT):
            kind = KINDS[(index * PER_CLIENT + j) % len(KINDS)]
            try:
                await one_request(client, speech_body(kind, voice, ref, seed=index * 10 + j), kind, tally)
            except (httpx.HTTPError, AssertionError, ValueError) as err:
                tally.errors.append(f"{kind}: {type(err).__name__}: {err}")


async def save_voice(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        files = {"audio_sample": ("p.wav", good_wav(), "audio/wav")}
        r = await client.post("/v1/audio/voices", data={"name": "load test", "ref_text": "Hi."}, files=files)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


async def test_bounded_load_mixed_requests(engine, server):
    voice, ref = await save_voice(server), base64.b64encode(good_wav()).decode("ascii")
    warm = Tally()
    await asyncio.gather(*(client_run(server, i, voice, ref, warm) for i in range(4)))  # warm-up round
    assert not warm.errors, warm.errors
    assert await wait_idle(engine), idle_state(engine)
    rss_before, t0 = rss_mb(), time.monotonic()

    tally = Tally()
    await asyncio.wait_for(
        asyncio.gather(*(client_run(server, i, voice, ref, tally) for i in range(CLIENTS))), DEADLINE_S
    )
    elapsed = time.monotonic() - t0
    assert await wait_idle(engine), idle_state(engine)
    rss_after = rss_mb()

    log.info(
        "load: %d requests in %.1f s, %s, %d refused (429), TTFA p50/p95 %.0f/%.0f ms, whole-request "
        "p50/p95 %.2f/%.2f s, RSS %.0f -> %.0f MiB",
        sum(tally.done.values()), elapsed, dict(tally.done), tally.refused,
        *np.percentile(tally.ttfa_ms, [50, 95]), *np.percentile(tally.latency_s, [50, 95]),
        rss_before, rss_after,
    )  # fmt: skip
    assert not tally.errors, tally.errors
    assert sum(tally.done.values()) == CLIENTS * PER_CLIENT
    assert tally.done == Counter({k: CLIENTS * PER_CLIENT // len(KINDS) for k in KINDS})
    assert tally.refused > 0  # 16 clients against 4 + 4 places: the limits were really exercised
    assert elapsed < DEADLINE_S
    stats = engine.stats()
    assert (stats.active_streams, stats.queued, engine.backend.active, engine.token2wav.pending) == (
        0,
        0,
        0,
        0,
    )
    assert not any(engine.abort(rid) for rid in tally.request_ids)  # no request is still registered
    assert rss_after - rss_before < RSS_GROWTH_MB, (rss_before, rss_after)
