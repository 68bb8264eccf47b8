"""v2's own cases of flow frame reuse (engine.flow.unet_cache): its conv states, a failed call, the budget.
The scenarios both families share (streamed calls, batches, a full budget) are in test_dit_cache."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.flow.dit_cache import ReuseBudget
from engine.flow.unet_cache import UNetCache
from tests.engine.flow.test_dit_cache import Voice, tiny_flow, voice
from tests.engine.flow.test_dit_cache import run as shared_run


def run(voices: list[Voice], counts: list[int], caches: list[UNetCache] | None = None) -> torch.Tensor:
    """One padded streaming call of the tiny v2 flow -> generated mel."""
    return shared_run(voices, counts, caches, family="cosyvoice2")


def test_a_stream_keeps_a_state_for_every_causal_conv() -> None:
    v, cache = voice(13, seed=0), UNetCache()
    for n in (20, 41, 90):  # the streamed scenarios themselves: test_dit_cache, parametrized by family
        run([v], [n], [cache])
    assert cache.states is not None and len(cache.states) == 4 * 2 + 3  # 2 a resnet (4), 3 more
    assert [tuple(st.shape[:2]) for st in cache.states] == [(10, 2)] * 11  # steps, CFG rows


def test_a_failed_call_leaves_the_cache_as_it_was() -> None:
    v, cache = voice(13, seed=3), UNetCache()
    run([v], [41], [cache])  # 102 frames: 100 kept
    assert cache.states is not None
    states, frames = [s.clone() for s in cache.states], cache.frames
    flow = tiny_flow("cosyvoice2")
    real = flow.decoder.estimator.forward_window

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    flow.decoder.estimator.forward_window = fail  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            run([v], [90], [cache])
    finally:
        flow.decoder.estimator.forward_window = real  # type: ignore[method-assign]
    assert cache.frames == frames and all(torch.equal(a, b) for a, b in zip(states, cache.states))
    torch.testing.assert_close(run([v], [90], [cache])[..., 76:], run([v], [90])[..., 76:], atol=1e-4, rtol=0)


def test_the_budget_counts_the_conv_states_and_gets_every_byte_back() -> None:
    budget = ReuseBudget(2**40)
    cache = UNetCache(budget)
    run([voice(13, seed=5)], [41], [cache])  # 100 frames kept
    assert cache.states is not None
    states = sum(s.numel() * s.element_size() for s in cache.states)
    assert budget.held == cache.nbytes == states + 2 * cache.keys.numel() * cache.keys.element_size()
    del cache  # a cancelled request's Utterance goes away
    gc.collect()
    assert budget.held == 0
