"""The native backend's worker thread: healthy while it runs, not once closed."""

from __future__ import annotations

import asyncio

import torch

from engine.checkpoint import load_model
from engine.config import SamplingConfig
from engine.demo.make_model import build_model_dir
from engine.hub import validate_model_dir
from engine.lm.backend import LMRequest
from engine.lm.native import NativeLM


def test_healthy_while_its_worker_runs(tmp_path):
    model = load_model(
        validate_model_dir(build_model_dir(tmp_path, "cosyvoice3", "tiny")), torch.device("cpu")
    )
    lm = NativeLM(model.lm, SamplingConfig())
    assert lm.healthy and lm.active == 0
    lm.close()
    assert not lm.healthy


async def test_a_waiting_listener_is_admitted_before_a_buffered_one(tmp_path):
    """One decode slot, busy: an URGENT request (its listener has no audio) that arrives after a BUFFERED
    one is started first when the slot frees; arrival order holds within a priority."""
    model = load_model(
        validate_model_dir(build_model_dir(tmp_path, "cosyvoice3", "tiny")), torch.device("cpu")
    )
    lm = NativeLM(model.lm, SamplingConfig(), max_batch=1)
    prefix = torch.zeros(3, model.lm.config.hidden_size)
    stops = tuple(sorted(model.lm.config.stop_ids))

    def request(name: str, tokens: int, priority: int) -> LMRequest:
        return LMRequest(name, prefix, 0, tokens, tokens, stops, priority)

    order: list[str] = []

    async def run(req: LMRequest) -> None:
        async for _ in lm.generate(req):
            order.append(req.request_id)

    try:
        busy = asyncio.create_task(run(request("busy", 40, LMRequest.URGENT)))
        while not order:  # the slot is taken
            await asyncio.sleep(0.01)
        later = [request("b1", 3, LMRequest.BUFFERED), request("u1", 3, LMRequest.URGENT),
                 request("b2", 3, LMRequest.BUFFERED), request("u2", 3, LMRequest.URGENT)]  # fmt: skip
        await asyncio.gather(busy, *(run(r) for r in later))
    finally:
        lm.close()
    starts = [name for i, name in enumerate(order) if name not in order[:i]]
    assert starts == ["busy", "u1", "u2", "b1", "b2"]
