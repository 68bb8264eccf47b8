"""Streaming v2 flow calls that reuse a request's finished frames (engine.models.unet_cache) emit what the
full recompute emits, alone and in padded batches whose rows have different cache boundaries."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from bench.make_model import randomize
from engine.models.dit_cache import ReuseBudget
from engine.models.flow import CosyVoice2Flow, CosyVoice2FlowConfig
from engine.models.flow_encoder import EncoderConfig
from engine.models.unet import UNetConfig
from engine.models.unet_cache import UNetCache
from tests.engine.models.test_dit_cache import Voice, _stack, voice

CHUNK = UNetConfig().static_chunk_size  # 50 frames, counted from frame 0 (prompt included)


@functools.cache
def tiny_flow() -> CosyVoice2Flow:
    """bench's tiny v2 sizes, seeded random weights (no fixtures needed)."""
    enc = EncoderConfig(input_size=64, output_size=64, attention_heads=4, linear_units=128, num_blocks=2)
    unet = UNetConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2, num_heads=4)
    flow = CosyVoice2Flow(CosyVoice2FlowConfig(input_size=64, encoder=enc, estimator=unet)).eval()
    randomize(flow, seed=1)
    return flow


def run(voices: list[Voice], counts: list[int], caches: list[UNetCache] | None = None) -> torch.Tensor:
    """One padded streaming call: row i on the first counts[i] tokens of voices[i] -> generated mel."""
    return tiny_flow().inference(
        token=_stack([v.tokens[:, :n] for v, n in zip(voices, counts)]),
        token_len=torch.tensor(counts),
        prompt_token=_stack([v.prompt for v in voices]),
        prompt_token_len=torch.tensor([v.prompt.size(1) for v in voices]),
        prompt_feat=_stack([v.feat for v in voices]),
        prompt_feat_len=torch.tensor([v.prompt_frames for v in voices]),
        embedding=torch.cat([v.embedding for v in voices]),
        streaming=True,
        finalize=False,
        caches=caches,
    )


def test_streamed_calls_reusing_frames_emit_what_recomputing_emits() -> None:
    v = voice(13, seed=0)  # 26 prompt frames: the speech starts inside the first chunk
    cache, emitted = UNetCache(), 0
    counts = (20, 41, 63, 90, 140, 201)  # frames 60, 102, 146, 200, 300, 422
    for n in counts:
        start, queried = cache.frames, cache.queried
        want, got = run([v], [n]), run([v], [n], [cache])
        assert got.shape == want.shape
        assert start <= v.prompt_frames + emitted
        torch.testing.assert_close(got[..., emitted:], want[..., emitted:], atol=1e-4, rtol=0)
        assert not got[..., : max(start - v.prompt_frames, 0)].any()  # before the window: not computed
        total = v.frames(n)
        assert (cache.frames, cache.queried - queried) == (total // CHUNK * CHUNK, total - start)
        emitted = want.size(2)
    assert cache.states is not None and len(cache.states) == 4 * 2 + 3  # 2 a resnet (4), 3 more
    assert cache.calls == 6 and cache.queried < sum(v.frames(n) for n in counts) / 2


def test_a_batch_with_different_cache_boundaries_equals_each_row_recomputed_alone() -> None:
    voices = [voice(13, seed=1), voice(31, seed=2)]  # 26 and 62 prompt frames
    caches = [UNetCache(), UNetCache()]
    run(voices[:1], [90], caches[:1])  # row 0 runs ahead alone: 200 frames cached, row 1 none
    emitted = [voices[0].frames(90) - voices[0].prompt_frames, 0]
    starts = []
    for counts in ((100, 20), (130, 60), (133, 95)):
        starts.append([c.frames for c in caches])
        got = run(voices, list(counts), caches)
        for i, (v, n) in enumerate(zip(voices, counts)):
            want = run([v], [n])
            end = want.size(2)
            torch.testing.assert_close(
                got[i : i + 1, :, emitted[i] : end], want[..., emitted[i] :], atol=1e-4, rtol=0
            )
            assert not got[i, :, end:].any()  # the shorter row's padding stays zero
            emitted[i] = end
    assert starts == [[200, 0], [200, 50], [250, 150]]
    assert [c.frames for c in caches] == [250, 200]


def test_a_failed_call_leaves_the_cache_as_it_was() -> None:
    v, cache = voice(13, seed=3), UNetCache()
    run([v], [41], [cache])  # 102 frames: 100 kept
    assert cache.states is not None
    states, frames = [s.clone() for s in cache.states], cache.frames
    flow = tiny_flow()
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


def test_a_full_budget_stops_a_cache_growing_and_the_audio_stays_exact() -> None:
    v, budget = voice(13, seed=4), ReuseBudget(2**40)
    cache, emitted = UNetCache(budget), 0
    for n in (20, 41, 90, 140):  # 60 frames (50 kept), then 102, 182, 282
        want, got = run([v], [n]), run([v], [n], [cache])
        torch.testing.assert_close(got[..., emitted:], want[..., emitted:], atol=1e-4, rtol=0)
        emitted = want.size(2)
        budget.limit = budget.held  # full after the first call: the cache may not grow
    assert cache.frames == 50 and cache.calls == 4  # every later call reused the 50 frames (and states)
    cache.clear()
    assert budget.held == 0


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
