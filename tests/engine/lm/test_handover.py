"""The LM handover: the first backend serves while the second starts; at the switch new requests go to the
second, those in flight finish on the first (none lost, none decoded twice), then the first is closed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future

import pytest
import torch

from engine.config import SamplingConfig
from engine.lm.backend import LMBackend, LMRequest
from engine.lm.bistream import Round
from engine.lm.handover import PHASE, REHEARSAL_TOKENS, HandoverLM
from engine.serving.startup import Timeline
from tests.conftest import WAIT_S


class GatedLM:
    """A backend whose requests each emit ``tokens`` ids (offset by ``base``), one per opening of their
    gate: a test holds a request in flight across the switch."""

    def __init__(self, name: str, base: int, tokens: int = 3):
        self.name, self.base, self.tokens = name, base, tokens
        self.served: list[str] = []
        self.requests: list[tuple[LMRequest, asyncio.AbstractEventLoop]] = []  # each as given, and its loop
        self.gates: dict[str, asyncio.Queue[None]] = {}
        self.closed = False
        self._active = 0

    @property
    def active(self) -> int:
        return self._active

    @property
    def healthy(self) -> bool:
        return not self.closed

    def gate(self, request_id: str) -> asyncio.Queue[None]:
        return self.gates.setdefault(request_id, asyncio.Queue())

    async def generate(self, req: LMRequest) -> AsyncIterator[int]:
        assert not self.closed, f"{self.name} got {req.request_id} after it was closed"
        self.served.append(req.request_id)
        self.requests.append((req, asyncio.get_running_loop()))
        self._active += 1
        try:
            for i in range(self.tokens):
                await self.gate(req.request_id).get()
                yield self.base + i
        finally:
            self._active -= 1

    def session(self, request_id: str, seed: int) -> GatedSession:
        self.served.append(request_id)
        self._active += 1
        return GatedSession(self)

    def close(self) -> None:
        self.closed = True


class GatedSession:
    def __init__(self, lm: GatedLM):
        self.lm = lm

    async def round(self, rnd: Round) -> AsyncIterator[int]:
        yield self.lm.base

    async def aclose(self) -> None:
        self.lm._active -= 1


def request(name: str) -> LMRequest:
    return LMRequest(name, torch.zeros(2, 4), seed=0, min_len=1, max_len=3, stop_ids=(99,))


async def pulled(tokens: AsyncIterator[int], gates: asyncio.Queue[None], n: int) -> list[int]:
    out = []
    for _ in range(n):
        gates.put_nowait(None)
        out.append(await anext(tokens))
    return out


async def waited(wait, *args) -> bool:
    return bool(await asyncio.to_thread(wait, *args))


def rehearsal_passes(backend: GatedLM, of: str) -> None:
    """Open the gates of the rehearsal of request ``of`` that the handover runs on ``backend``."""
    for _ in range(backend.tokens):
        backend.gate(f"{of}-rehearsal").put_nowait(None)


async def test_requests_in_flight_at_the_switch_finish_on_the_first_and_new_ones_go_to_the_second():
    first, second, started = GatedLM("native", 100), GatedLM("vllm", 200), Future[LMBackend]()
    timeline, released = Timeline(), []
    lm = HandoverLM(first, started, timeline, release=lambda: released.append(True))
    assert lm.name == "native" and PHASE in timeline.pending()

    early = lm.generate(request("early"))
    got_early = await pulled(early, first.gate("early"), 1)  # in flight on the first backend
    rehearsal_passes(second, "early")
    started.set_result(second)  # the second backend is up
    assert await waited(lm.wait_upgraded, WAIT_S)
    assert lm.name == "vllm" and not first.closed  # "early" still runs there

    late = lm.generate(request("late"))
    got_late = await pulled(late, second.gate("late"), 3)
    got_early += await pulled(early, first.gate("early"), 2)
    assert not first.closed and lm.active == 2
    with pytest.raises(StopAsyncIteration):  # each ends after its own tokens: nothing lost or repeated
        await pulled(early, first.gate("early"), 1)
    assert await waited(lm.wait_settled, WAIT_S)

    # each request decoded exactly once; the second rehearsed the first request before it took any
    assert (first.served, second.served) == (["early"], ["early-rehearsal", "late"])
    assert (got_early, got_late) == ([100, 101, 102], [200, 201, 202])
    assert first.closed and released == [True] and not second.closed
    assert PHASE not in timeline.pending() and PHASE in [p.name for p in timeline.phases]
    await late.aclose()
    assert lm.active == 0 and lm.healthy


async def test_a_caller_that_leaves_during_the_switch_still_lets_the_first_retire():
    first, second, started = GatedLM("native", 0), GatedLM("vllm", 0), Future[LMBackend]()
    lm = HandoverLM(first, started)
    left = lm.generate(request("left"))
    await pulled(left, first.gate("left"), 1)
    rehearsal_passes(second, "left")
    started.set_result(second)
    assert await waited(lm.wait_upgraded, WAIT_S) and not first.closed
    await left.aclose()  # the client went away mid-request
    assert await waited(lm.wait_settled, WAIT_S) and first.closed


async def test_the_second_rehearses_the_first_request_shortened_on_its_loop_before_the_switch():
    """A backend's first request pays for its lazy set-up (vLLM: ~250 ms more to first audio on the H200):
    the handover has the second decode a short copy of the first routed request, on that request's loop
    (vLLM's output loop binds to it), before any visitor's request goes there."""
    first, second, started = GatedLM("native", 0), GatedLM("vllm", 0), Future[LMBackend]()
    lm = HandoverLM(first, started)
    long = LMRequest("warm-up", torch.ones(6, 4), seed=3, min_len=20, max_len=500, stop_ids=(99,))
    assert [t async for t in _opened(lm.generate(long), first.gate("warm-up"), first.tokens)] == [0, 1, 2]
    later = lm.generate(request("second-on-first"))  # a later request is not the one rehearsed
    await pulled(later, first.gate("second-on-first"), 3)
    started.set_result(second)
    assert not await waited(lm.wait_upgraded, 0.2) and lm.name == "native"  # held until it is rehearsed
    rehearsal_passes(second, "warm-up")
    assert await waited(lm.wait_upgraded, WAIT_S)
    [(rehearsed, loop)] = second.requests
    assert loop is asyncio.get_running_loop() and rehearsed.request_id == "warm-up-rehearsal"
    assert (rehearsed.min_len, rehearsed.max_len) == (REHEARSAL_TOKENS, REHEARSAL_TOKENS) < (20, 500)
    assert torch.equal(rehearsed.prefix, long.prefix) and rehearsed.seed == 3
    await later.aclose()
    assert await waited(lm.wait_settled, WAIT_S) and first.closed


@pytest.mark.parametrize("how", ["raises", "never ends"])
async def test_a_failed_rehearsal_closes_the_second_and_leaves_the_first_serving(how, monkeypatch, caplog):
    first, second, started, timeline = (
        GatedLM("native", 5),
        GatedLM("vllm", 0),
        Future[LMBackend](),
        Timeline(),
    )
    monkeypatch.setattr("engine.lm.handover.REHEARSAL_S", 0.5)
    lm = HandoverLM(first, started, timeline)
    assert await pulled(lm.generate(request("a")), first.gate("a"), 3) == [5, 6, 7]
    if how == "raises":
        second.gate("a-rehearsal").put_nowait(None)
        second.tokens = 0  # its generate then ends in the error below, as vLLM's dead engine core would
        monkeypatch.setattr(second, "generate", _failing(second.generate))
    with caplog.at_level(logging.ERROR, "engine.lm.handover"):
        started.set_result(second)
        assert await waited(lm.wait_settled, WAIT_S)
    assert "failed its rehearsal" in caplog.text and second.closed and not first.closed
    assert lm.name == "native" and lm.healthy and timeline.pending() == []
    assert await pulled(lm.generate(request("b")), first.gate("b"), 3) == [5, 6, 7]


async def test_nothing_is_rehearsed_when_no_request_came_before_or_its_loop_has_ended():
    first, second, started = GatedLM("native", 0), GatedLM("vllm", 0), Future[LMBackend]()
    lm = HandoverLM(first, started)
    started.set_result(second)  # up before any request (vLLM ready before the engine's warm-up)
    assert await waited(lm.wait_settled, WAIT_S) and second.served == [] and first.closed

    first, second, started = GatedLM("native", 0), GatedLM("vllm", 0), Future[LMBackend]()
    lm = HandoverLM(first, started)

    async def own_loop() -> list[int]:  # a caller's own asyncio.run: its loop is gone at the switch
        return [t async for t in _opened(lm.generate(request("cli")), first.gate("cli"), 3)]

    assert await asyncio.to_thread(asyncio.run, own_loop()) == [0, 1, 2]
    started.set_result(second)
    assert await waited(lm.wait_settled, WAIT_S) and second.served == [] and lm.name == "vllm"

    first, second, started = GatedLM("native", 0), GatedLM("vllm", 0), Future[LMBackend]()
    lm = HandoverLM(first, started)
    kept = asyncio.new_event_loop()  # run once and left open, not running: it would never run a rehearsal
    try:
        assert await asyncio.to_thread(kept.run_until_complete, own_loop()) == [0, 1, 2]
        started.set_result(second)
        assert await waited(lm.wait_settled, WAIT_S) and second.served == [] and lm.name == "vllm"
    finally:
        kept.close()


async def _opened(tokens: AsyncIterator[int], gates: asyncio.Queue[None], n: int) -> AsyncIterator[int]:
    for _ in range(n):
        gates.put_nowait(None)
    async for tok in tokens:
        yield tok


def _failing(generate):
    async def failing(req: LMRequest) -> AsyncIterator[int]:
        async for tok in generate(req):
            yield tok
        raise RuntimeError("EngineDeadError: the engine core died")

    return failing


async def test_a_session_stays_on_its_backend_until_it_ends():
    first, second, started = GatedLM("native", 7), GatedLM("vllm", 8), Future[LMBackend]()
    lm = HandoverLM(first, started)
    live = lm.session("live", seed=1)  # a text-streaming request: rounds over minutes
    started.set_result(second)
    assert await waited(lm.wait_upgraded, WAIT_S)
    rnd = Round(feeds=(), budget=1, final=True)
    assert [t async for t in live.round(rnd)] == [7]  # its later rounds stay where its state is
    assert not await waited(lm.wait_settled, 0.0) and not first.closed
    await live.aclose()
    await live.aclose()  # twice: counted once
    assert await waited(lm.wait_settled, WAIT_S) and first.closed
    assert (first.served, second.served) == (["live"], [])


async def test_a_failed_start_leaves_the_first_serving(caplog):
    first, started, timeline = GatedLM("native", 5), Future[LMBackend](), Timeline()
    lm = HandoverLM(first, started, timeline)
    with caplog.at_level(logging.ERROR, "engine.lm.handover"):
        started.set_exception(RuntimeError("vLLM's engine core died"))
        assert await waited(lm.wait_settled, WAIT_S)
    assert "failed to start" in caplog.text and "engine core died" in caplog.text
    assert lm.name == "native" and not first.closed and lm.healthy
    assert timeline.pending() == []  # nothing left to wait for: /ready reads steady, on the native loop
    tokens = lm.generate(request("after"))
    assert await pulled(tokens, first.gate("after"), 3) == [5, 6, 7]


async def test_closing_before_the_second_is_up_closes_it_when_it_comes():
    first, second, started = GatedLM("native", 0), GatedLM("vllm", 0), Future[LMBackend]()
    lm = HandoverLM(first, started)
    lm.close()  # the server stops during vLLM's start
    assert first.closed and not second.closed
    started.set_result(second)  # its engine core must not outlive the server
    assert second.closed and await waited(lm.wait_settled, WAIT_S)
    assert lm.name == "native"  # never switched: nothing new goes anywhere after close


async def test_the_same_seed_gives_the_same_tokens_on_either_side_of_the_switch(tmp_path):
    """Two native loops on one tiny LM stand for the two backends: a request's tokens depend on its seed,
    not on which backend the handover gave it to (the sampling is the same RAS code on both)."""
    from engine.checkpoint import load_model
    from engine.demo.make_model import build_model_dir
    from engine.hub import validate_model_dir
    from engine.lm.native import NativeLM

    model = load_model(
        validate_model_dir(build_model_dir(tmp_path, "cosyvoice2", "tiny")), torch.device("cpu")
    )
    stops = tuple(sorted(model.lm.config.stop_ids))
    prefix = torch.randn(5, model.lm.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def req(name: str) -> LMRequest:
        return LMRequest(name, prefix, seed=42, min_len=8, max_len=8, stop_ids=stops)

    first, second = NativeLM(model.lm, SamplingConfig()), NativeLM(model.lm, SamplingConfig())
    started = Future[LMBackend]()
    lm = HandoverLM(first, started)
    try:
        before = [t async for t in lm.generate(req("before"))]
        started.set_result(second)
        assert await waited(lm.wait_settled, WAIT_S) and not first.healthy  # retired: its thread ended
        after = [t async for t in lm.generate(req("after"))]
    finally:
        lm.close()
    assert len(before) == 8 and before == after


def test_a_start_gate_lets_its_waiter_go_once_opened_and_a_cancel_after_changes_nothing():
    import threading

    from engine.lm.handover import StartGate

    gate, passed = StartGate(), threading.Event()
    waiter = threading.Thread(target=lambda: (gate.wait(), passed.set()))
    waiter.start()
    assert not passed.wait(0.05)  # held
    gate.open()
    waiter.join(5.0)
    assert passed.is_set()
    gate.cancel()
    gate.wait()  # still open: returns


def test_a_cancelled_start_gate_raises_in_its_waiter_and_stays_cancelled():
    import pytest

    from engine.lm.handover import GateCancelled, StartGate

    gate = StartGate()
    gate.cancel()
    gate.open()
    with pytest.raises(GateCancelled, match="not started"):
        gate.wait()
