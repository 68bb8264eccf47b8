"""Cancellation on a real tiny engine: a client that leaves (HTTP stream closed, UI Stop, generator closed,
task cancelled, abort while queued) frees its admission slot, LM sequence and token2wav jobs within about
one chunk; and a request that raises (vocoder, flow or LM, for that request only) never leaves the others
stuck."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from api.app import build_api
from engine.request import SynthesisRequest
from engine.serving.engine import TTSEngine
from tests.api.support import live_server
from tests.conftest import WAIT_S
from tests.reliability.support import (
    LIMITS,
    TEXT,
    Bounded,
    assert_serves,
    check_pcm,
    collect,
    good_request,
    idle_state,
    wait_idle,
)
from webui.handlers import Form, Studio
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts

log = logging.getLogger(__name__)

LONG = 400  # speech tokens of a "long" request: ~6 streamed chunks, several seconds of CPU


def long_request(prompt, **kw: Any) -> SynthesisRequest:
    return good_request(prompt, forced_tokens=LONG, stream=True, **kw)


async def freed_after(engine: TTSEngine, t0: float) -> float:
    """Seconds from ``t0`` until the engine is idle (fails the test if it never is). The callers check that
    the request stopped early by its LM tokens, not by this time, which a busy machine stretches."""
    assert await wait_idle(engine, timeout_s=WAIT_S), idle_state(engine)
    seconds = time.monotonic() - t0
    log.info("freed %.3f s after the client left", seconds)
    return seconds


def tokens_total(engine: TTSEngine) -> int:
    return engine.stats().lm_tokens_total


# ======================================================================================== client leaves


@pytest.fixture(scope="module")
def server(engine) -> Iterator[str]:
    with live_server(build_api(Bounded(engine, LONG), LIMITS, api_key="")) as url:
        yield url


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
async def test_http_stream_closed_midway_frees_everything(engine, prompt, server, stream_format):
    body = {
        "input": TEXT, "mode": "cross_lingual", "stream": True, "stream_format": stream_format,
        "response_format": "pcm", "ref_audio": _b64(prompt.read_bytes()), "seed": 3,
    }  # fmt: skip
    before = tokens_total(engine)
    async with (
        httpx.AsyncClient(base_url=server, timeout=WAIT_S) as client,
        client.stream("POST", "/v1/audio/speech", json=body) as r,
    ):
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        async for data in r.aiter_bytes():
            assert data
            break  # the first bytes arrived: hang up
        t0 = time.monotonic()
    await freed_after(engine, t0)
    assert not engine.abort(rid)  # no longer registered
    assert tokens_total(engine) - before < LONG  # it stopped early, it did not run to the end
    await assert_serves(engine, prompt)


async def test_ui_stop_frees_everything_and_keeps_the_audio(engine, tmp_path):
    from tests.sounds import write_wav

    ui_prompt = str(write_wav(tmp_path / "p.wav", 3.0))
    studio = Studio(Bounded(engine, LONG), LIMITS, Texts("en"), StreamHub(), AudioStore(tmp_path / "store"))
    rid = "ab" * 16
    values = {
        "mode": "cross_lingual", "prompt_wav": ui_prompt, "prompt_text": "", "instruct_text": "",
        "source_wav": None, "voice_id": None, "language": "auto", "text": TEXT, "stream": True,
        "speed": 1.0, "seed": 1, "rid": rid, "history": (),
    }  # fmt: skip
    outputs, t0 = [], 0.0
    before = tokens_total(engine)
    async for out in studio.generate(Form(**values)):
        outputs.append(out)
        if len(outputs) == 1:  # the first chunk is in: the user presses Stop
            studio.stop(rid)
            t0 = time.monotonic()
    log.info("the studio's stream ended %.3f s after Stop", time.monotonic() - t0)
    await freed_after(engine, t0)
    final = outputs[-1]
    assert 'data-state="stopped"' in final[2] and final[0]["value"]  # the audio made so far is kept
    assert tokens_total(engine) - before < LONG


async def test_closed_generator_frees_everything(engine, prompt):
    before = tokens_total(engine)
    gen = engine.stream(long_request(prompt))
    first = await anext(gen)
    check_pcm(first.pcm)
    t0 = time.monotonic()
    await gen.aclose()
    await freed_after(engine, t0)
    assert tokens_total(engine) - before < LONG  # it stopped early, it did not run to the end
    await assert_serves(engine, prompt)


async def test_task_cancelled_mid_chunk_frees_everything(engine, prompt):
    """Cancelled while awaiting the LM or a token2wav job (what a server does when its client leaves)."""
    got = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.stream(long_request(prompt)):
            got.set()

    before = tokens_total(engine)
    task = asyncio.create_task(consume())
    await asyncio.wait_for(got.wait(), WAIT_S)
    await asyncio.sleep(0.05)  # now inside the next chunk's computation
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await freed_after(engine, t0)
    assert tokens_total(engine) - before < LONG
    await assert_serves(engine, prompt)


@pytest.fixture
async def full(engine) -> Any:
    """Every admission slot taken (as by long requests), so the next request waits in the queue."""
    for _ in range(LIMITS.max_concurrency):
        await engine.admission.acquire()
    held = LIMITS.max_concurrency
    try:
        yield
    finally:
        for _ in range(held):
            engine.admission.release()


async def test_cancelled_while_queued_frees_the_queue_place(engine, prompt, full):
    task = asyncio.create_task(collect(engine, long_request(prompt)))
    assert await _until(lambda: engine.admission.queued == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.admission.queued == 0 and engine.admission.active == LIMITS.max_concurrency
    assert engine.backend.active == 0


async def test_aborted_while_queued_computes_nothing_once_admitted(engine, prompt, full):
    req = long_request(prompt)
    task = asyncio.create_task(collect(engine, req))
    assert await _until(lambda: engine.admission.queued == 1)
    before = tokens_total(engine)
    assert engine.abort(req.request_id)
    engine.admission.release()  # a slot frees: the aborted request is admitted and must end at once
    chunks = await asyncio.wait_for(task, WAIT_S)
    await engine.admission.acquire()  # give the fixture its slot back
    assert chunks == [] and tokens_total(engine) - before <= 1
    assert await _until(lambda: engine.backend.active == 0)  # see test_engine_survives_a_closed_client_loop


async def _until(predicate: Any, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


# =============================================================================== one request raises


class Poison(RuntimeError):
    pass


def marked(utt: Any, tokens: int) -> bool:
    return bool(utt.prompt_tokens.shape[1] == tokens)


def poison_vocoder(engine: TTSEngine, monkeypatch, tokens: int) -> None:
    """The vocoder raises for the request whose prompt has ``tokens`` speech tokens (its own prompt)."""
    real = engine.token2wav._vocode

    def vocode(utt, mel, finalize):
        if marked(utt, tokens):
            raise Poison("vocoder failed for this request")
        return real(utt, mel, finalize)

    real_batch = engine.token2wav._vocode_batch

    def vocode_batch(utts, mel):  # v3 rows vocoded together: the batch fails, then each runs alone
        if any(marked(u, tokens) for u in utts):
            raise Poison("vocoder failed for this request")
        return real_batch(utts, mel)

    real_finals = engine.token2wav._v3_finals

    def v3_finals(jobs, mels):  # v3 final rows vocoded together: likewise
        if any(marked(j.utt, tokens) for j in jobs):
            raise Poison("vocoder failed for this request")
        return real_finals(jobs, mels)

    monkeypatch.setattr(engine.token2wav, "_vocode", vocode)
    monkeypatch.setattr(engine.token2wav, "_vocode_batch", vocode_batch)
    monkeypatch.setattr(engine.token2wav, "_v3_finals", v3_finals)


def poison_flow(engine: TTSEngine, monkeypatch, tokens: int) -> None:
    """The flow raises when the marked request is in its batch."""
    real = engine.token2wav._flow

    def flow(utts, chunks):
        if any(marked(u, tokens) for u in utts):
            raise Poison("flow failed for this request")
        return real(utts, chunks)

    monkeypatch.setattr(engine.token2wav, "_flow", flow)


def one_batch(engine: TTSEngine, monkeypatch, n: int) -> None:
    """The token2wav worker's first batch waits (up to WAIT_S) until ``n`` jobs are queued, so they share one
    flow batch whatever the thread timing (they are all due now: urgent jobs always join the batch)."""
    import engine.serving.job_queue as job_queue

    queue, real, waited = engine.token2wav.scheduler._queue, job_queue.pick_batch, []

    def pick_batch(queued, *args):  # called by the worker with the queue's lock held
        if not waited:
            waited.append(True)  # the wait releases the lock, so requests can queue their jobs
            queue._changed.wait_for(lambda: len(queued) >= n, timeout=WAIT_S)
        return real(queued, *args)

    monkeypatch.setattr(job_queue, "pick_batch", pick_batch)


def spy_prefill(engine: TTSEngine, monkeypatch) -> list[int]:
    """Record the prefix length (embeddings) of every LM prefill."""
    lm = engine.backend.lm  # type: ignore[attr-defined]
    real, seen = lm.prefill, []

    def prefill(prefix, cache):
        seen.append(prefix.shape[0])
        return real(prefix, cache)

    monkeypatch.setattr(lm, "prefill", prefill)
    return seen


def poison_lm(engine: TTSEngine, monkeypatch, longest: int) -> None:
    """The LM prefill raises for a request whose prefix is longer than ``longest`` (a longer text)."""
    lm = engine.backend.lm  # type: ignore[attr-defined]
    real = lm.prefill

    def prefill(prefix, cache):
        if prefix.shape[0] > longest:
            raise Poison("LM prefill failed for this request")
        return real(prefix, cache)

    monkeypatch.setattr(lm, "prefill", prefill)


# The flow and the LM run several requests in one batch; a failure there must fail only the request at
# fault (token2wav re-runs a failed batch's requests one by one; the LM prefills requests one by one).
FAULT_SITES = [
    pytest.param("vocoder", id="vocoder"),
    pytest.param("flow", id="flow"),
    pytest.param("lm", id="lm"),
]


@pytest.mark.parametrize("site", FAULT_SITES)
async def test_a_request_that_raises_never_leaves_others_stuck(engine, prompt, tmp_path, monkeypatch, site):
    """Three requests run; a fourth fails in the vocoder, the flow (in the same batch) or the LM (while the
    three decode). The three complete with exactly the audio they make alone."""
    from tests.sounds import write_wav

    odd_prompt = write_wav(tmp_path / "odd.wav", 2.0, seed=5)  # its own prompt length marks it
    odd_tokens = int(engine.frontend.extract(str(odd_prompt)).speech_tokens.size)
    others = [good_request(prompt, seed=s, forced_tokens=80, stream=False) for s in range(3)]
    prefixes = spy_prefill(engine, monkeypatch)
    alone = [np.concatenate([c.pcm for c in await collect(engine, r)]) for r in others]
    if site == "lm":
        bad = good_request(prompt, text=" ".join([TEXT] * 6), forced_tokens=80, stream=False)
        poison_lm(engine, monkeypatch, max(prefixes))
    else:
        bad = good_request(odd_prompt, forced_tokens=80, stream=False)
        one_batch(engine, monkeypatch, 4)
        (poison_vocoder if site == "vocoder" else poison_flow)(engine, monkeypatch, odd_tokens)
    tasks = [asyncio.create_task(collect(engine, r)) for r in others]
    assert await _until(lambda: engine.backend.active == 3)  # the three are decoding
    tasks.insert(0, asyncio.create_task(collect(engine, bad)))
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
    assert isinstance(results[0], Poison), results[0]
    for got, want in zip(results[1:], alone):
        assert not isinstance(got, BaseException), f"another request failed too: {got!r}"
        assert got[-1].is_last
        np.testing.assert_allclose(np.concatenate([c.pcm for c in got]), want, atol=1e-4)
    assert await wait_idle(engine), idle_state(engine)
    monkeypatch.undo()
    await assert_serves(engine, prompt)


# ============================================================================= the LM thread survives


def test_engine_survives_a_closed_client_loop(model_dir, prompt, tmp_path):
    """A caller's event loop closes while its request decodes (an embedding app or a test harness that
    does not close its generators). The engine must drop that request and keep serving the others; a
    dead decode thread would leave every later request waiting forever."""
    from tests.reliability.support import load_engine

    engine = load_engine(model_dir, tmp_path / "voices")  # its own: this test may break it
    try:
        loop = asyncio.new_event_loop()
        gen = engine.stream(good_request(prompt, forced_tokens=3000, stream=True))
        loop.run_until_complete(anext(gen))  # 3000 tokens: still decoding when the loop goes away
        loop.close()
        time.sleep(0.3)  # a few LM steps try to hand tokens to the closed loop

        async def after() -> list[Any]:
            return await asyncio.wait_for(collect(engine, good_request(prompt)), WAIT_S)

        check_pcm(np.concatenate([c.pcm for c in asyncio.run(after())]))
    finally:
        engine.close()
