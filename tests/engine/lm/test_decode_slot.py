"""The native loop's slot: a lone request's step over a fixed key/value buffer computes what the
per-request cache computes, and the loop's tokens are the same with the slot as without it through
requests joining, leaving and outgrowing it. The CUDA graph itself: the ``gpu`` test."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.checkpoint import load_model
from engine.config import SamplingConfig
from engine.demo.make_model import build_model_dir
from engine.hub import validate_model_dir
from engine.lm.backend import LMRequest
from engine.lm.decode_slot import DecodeSlot
from engine.lm.native import NativeLM
from engine.lm.speech_lm import SpeechLM


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> SpeechLM:
    folder = build_model_dir(tmp_path_factory.mktemp("model"), "cosyvoice3", "tiny")
    return load_model(validate_model_dir(folder), torch.device("cpu")).lm


class CountingSlot(DecodeSlot):
    """The slot, counting its adoptions and steps."""

    def __init__(self, lm: SpeechLM, capacity: int):
        super().__init__(lm, capacity, graphs=False)
        self.adopted = self.steps = 0

    def adopt(self, cache):
        self.adopted += 1
        super().adopt(cache)

    def step(self, last, cache):
        self.steps += 1
        return super().step(last, cache)


def _prefix(lm: SpeechLM, length: int, seed: int) -> torch.Tensor:
    return torch.randn(length, lm.config.hidden_size, generator=torch.Generator().manual_seed(seed))


def test_a_step_in_the_slot_equals_the_step_of_the_requests_own_cache(lm):
    """Prefill 7 positions, then 20 steps both ways: the same hidden states, and the slot's keys/values
    equal the cache's position for position (the positions past them untouched by the mask)."""
    with torch.inference_mode():
        own, moved = lm.new_cache(capacity=8), lm.new_cache(capacity=8)
        prefix = _prefix(lm, 7, 0)
        lm.prefill(prefix, own)
        lm.prefill(prefix, moved)
        slot = DecodeSlot(lm, capacity=64, graphs=False)
        slot.kv.normal_()  # stale values of an earlier request: finite, masked out
        slot.adopt(moved)
        ids = torch.randint(0, lm.config.speech_token_size, (20,), generator=torch.Generator().manual_seed(1))
        for i in ids.tolist():
            want = lm.decode(lm.speech_embeds(torch.tensor([i])), [own])
            got = slot.step(i, moved)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert slot.holds(moved) and moved.length == own.length == 27
    torch.testing.assert_close(slot.kv[:, :, :, :27], own.kv[:, :, :, :27], atol=1e-5, rtol=1e-5)


def test_the_step_refuses_a_cache_that_is_not_the_slot_or_has_no_room(lm):
    slot = DecodeSlot(lm, capacity=4, graphs=False)
    cache = lm.new_cache()
    with pytest.raises(ValueError, match="holds the slot"):
        slot.step(0, cache)
    cache.length = 4
    slot.adopt(cache)
    assert not slot.has_room(cache)
    with pytest.raises(ValueError, match="has room"):
        slot.step(0, cache)


async def _tokens(native: NativeLM, lm: SpeechLM, plan: list[tuple[str, int, int]]) -> dict[str, list[int]]:
    """Run requests (name, tokens, start after this many of the first request's tokens) to their end."""
    stops = tuple(sorted(lm.config.stop_ids))
    out: dict[str, list[int]] = {name: [] for name, _, _ in plan}
    started = {name: asyncio.Event() for name, _, _ in plan}

    async def run(index: int, name: str, tokens: int, after: int) -> None:
        if after:
            await started[name].wait()
        req = LMRequest(name, _prefix(lm, 5 + index, index), 10 + index, tokens, tokens, stops)
        async for token in native.generate(req):
            out[name].append(token)
            for other, _, other_after in plan:  # the first request's progress starts the others
                if index == 0 and len(out[name]) == other_after:
                    started[other].set()

    await asyncio.gather(*(run(i, *p) for i, p in enumerate(plan)))
    return out


@pytest.mark.parametrize(
    ("plan", "capacity"),
    [
        ([("alone", 30, 0)], 256),
        # b joins while a holds the slot and outlives it: a's cache is the slot in the batched steps, then b
        # adopts it once alone
        ([("a", 12, 0), ("b", 30, 6)], 256),
        # b joins and ends first: a keeps the slot throughout
        ([("a", 30, 0), ("b", 5, 4)], 256),
        # a outgrows a slot of 20 positions (a 5-position prefix + 15 tokens) and goes on op by op
        ([("a", 30, 0)], 20),
    ],
)
async def test_the_loop_samples_the_same_tokens_with_the_slot(lm, plan, capacity):
    plain = NativeLM(lm, SamplingConfig())
    try:
        want = await _tokens(plain, lm, plan)
    finally:
        plain.close()
    slot = CountingSlot(lm, capacity)
    slotted = NativeLM(lm, SamplingConfig(), slot=slot)
    try:
        got = await _tokens(slotted, lm, plan)
    finally:
        slotted.close()
    assert got == want and all(len(got[name]) == n for name, n, _ in plan)
    assert slot.steps >= 10 and slot.adopted >= 1
    if plan[0][1] == 12:  # b took the slot over once a had ended
        assert slot.adopted == 2


class FakeCapture:
    """``devices.CapturedCall`` on the CPU: counts captures; a replay runs the function again."""

    made = 0

    def __init__(self, fn, inputs):
        type(self).made += 1
        self.fn = fn
        fn(*inputs)  # the capture's warm-up run

    def __call__(self):
        return self.fn()


def _hidden_states(slot: DecodeSlot, lm: SpeechLM, steps: int) -> list[torch.Tensor]:
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.prefill(_prefix(lm, 6, 3), cache)
        slot.adopt(cache)
        return [slot.step(i, cache) for i in range(steps)]


@pytest.mark.parametrize("capture_fails", [False, True])
def test_the_step_is_captured_once_and_a_failed_capture_runs_it_op_by_op(lm, monkeypatch, capture_fails):
    """With graphs (faked on the CPU) the first step captures and later steps replay that capture; a
    capture that raises turns the slot's graphs off, and every step still gives the op-by-op result."""
    import engine.lm.decode_slot as decode_slot

    def failing(fn, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_slot.devices, "graphs_supported", lambda device: True)
    monkeypatch.setattr(FakeCapture, "made", 0)
    monkeypatch.setattr(decode_slot.devices, "CapturedCall", failing if capture_fails else FakeCapture)
    slot = DecodeSlot(lm, capacity=64)
    got = _hidden_states(slot, lm, 12)
    want = _hidden_states(DecodeSlot(lm, capacity=64, graphs=False), lm, 12)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=0, rtol=0)
    assert slot.graphs is not capture_fails and FakeCapture.made == (0 if capture_fails else 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_replayed_step_equals_the_step_op_by_op_on_cuda(lm):
    """The captured step on a CUDA device (bf16, as served): the same hidden states as the slot's step op
    by op, position after position, and the graph captured once."""
    gpu = SpeechLM(lm.config).to(torch.device("cuda"), torch.bfloat16)
    gpu.load_state_dict(lm.state_dict())
    with torch.inference_mode():
        caches = [gpu.new_cache(), gpu.new_cache()]
        prefix = _prefix(lm, 9, 2).to("cuda", torch.bfloat16)
        for cache in caches:
            gpu.prefill(prefix, cache)
        replayed, eager = DecodeSlot(gpu, capacity=128), DecodeSlot(gpu, capacity=128, graphs=False)
        replayed.adopt(caches[0])
        eager.adopt(caches[1])
        for i in range(40):
            torch.testing.assert_close(replayed.step(i, caches[0]), eager.step(i, caches[1]), atol=0, rtol=0)
    assert replayed.graphs and replayed._call is not None


def test_the_engine_builds_a_slot_only_where_it_can_be_replayed(lm):
    """Asked for on the CPU, no slot: op by op it would only add the masked reads of the whole buffer."""
    from engine.config import EngineConfig
    from engine.serving.engine import _decode_slot

    assert _decode_slot(EngineConfig(lm_native_graphs=True), lm) is None
    assert _decode_slot(EngineConfig(), lm) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
async def test_the_loop_samples_the_same_tokens_with_the_replayed_slot_on_cuda(lm):
    """The native loop on CUDA (float32: the same sums either way) with the slot's step captured on its
    decode thread and replayed: the same tokens as without a slot, through a join and a leave."""
    gpu = SpeechLM(lm.config).to(torch.device("cuda"))
    gpu.load_state_dict(lm.state_dict())
    plan = [("a", 40, 0), ("b", 12, 8)]
    plain = NativeLM(gpu, SamplingConfig())
    try:
        want = await _tokens(plain, gpu, plan)
    finally:
        plain.close()
    slot = DecodeSlot(gpu, capacity=256)
    slotted = NativeLM(gpu, SamplingConfig(), slot=slot)
    try:
        got = await _tokens(slotted, gpu, plan)
    finally:
        slotted.close()
    assert got == want and slot.graphs and slot._call is not None
