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
from engine.lm.handover import PHASE, HandoverLM
from engine.serving.startup import Timeline
from tests.conftest import WAIT_S


class GatedLM:
    """A backend whose requests each emit ``tokens`` ids (offset by ``base``), one per opening of their
    gate: a test holds a request in flight across the switch."""

    def __init__(self, name: str, base: int, tokens: int = 3):
        self.name, self.base, self.tokens = name, base, tokens
        self.served: list[str] = []
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


async def test_requests_in_flight_at_the_switch_finish_on_the_first_and_new_ones_go_to_the_second():
    first, second, started = GatedLM("native", 100), GatedLM("vllm", 200), Future[LMBackend]()
    timeline, released = Timeline(), []
    lm = HandoverLM(first, started, timeline, release=lambda: released.append(True))
    assert lm.name == "native" and PHASE in timeline.pending()

    early = lm.generate(request("early"))
    got_early = await pulled(early, first.gate("early"), 1)  # in flight on the first backend
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

    assert (first.served, second.served) == (["early"], ["late"])  # each request decoded exactly once
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
    started.set_result(second)
    assert await waited(lm.wait_upgraded, WAIT_S) and not first.closed
    await left.aclose()  # the client went away mid-request
    assert await waited(lm.wait_settled, WAIT_S) and first.closed


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
