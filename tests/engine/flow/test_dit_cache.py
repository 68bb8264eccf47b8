"""Streaming flow calls that reuse a request's finished frames emit what the full recompute emits, alone and
in padded batches whose rows have different cache boundaries: v3's DiT (engine.flow.dit_cache) and,
where a scenario is parametrized by family, v2's U-Net (engine.flow.unet_cache; its own cases:
test_unet_cache)."""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from engine.demo.make_model import randomize
from engine.flow.cfm import (
    CosyVoice2Flow,
    CosyVoice2FlowConfig,
    CosyVoice3Flow,
    CosyVoice3FlowConfig,
    Flow,
    FlowBatch,
)
from engine.flow.dit import DiTConfig
from engine.flow.dit_cache import DiTCache, ReuseBudget
from engine.flow.encoder import EncoderConfig
from engine.flow.unet import UNetConfig
from engine.flow.unet_cache import UNetCache

CHUNK = DiTConfig().static_chunk_size  # 50 frames, counted from frame 0 (prompt included)
LOOKAHEAD = CosyVoice3FlowConfig().pre_lookahead_len


@functools.cache
def tiny_flow(family: str = "cosyvoice3") -> Flow:
    """bench's tiny sizes of the family, seeded random weights (no fixtures needed)."""
    flow: Flow
    if family == "cosyvoice3":
        dit = DiTConfig(dim=64, depth=2, heads=4, dim_head=16)
        flow = CosyVoice3Flow(CosyVoice3FlowConfig(pre_lookahead_channels=64, estimator=dit))
    else:
        enc = EncoderConfig(input_size=64, output_size=64, attention_heads=4, linear_units=128, num_blocks=2)
        unet = UNetConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2, num_heads=4)
        flow = CosyVoice2Flow(CosyVoice2FlowConfig(input_size=64, encoder=enc, estimator=unet))
    randomize(flow.eval(), seed=1)
    return flow


# each family's cache, for the scenarios both run
CACHES: dict[str, type[DiTCache]] = {"cosyvoice3": DiTCache, "cosyvoice2": UNetCache}
families = pytest.mark.parametrize("family", list(CACHES))


@dataclass(frozen=True)
class Voice:
    """One request's flow inputs: prompt tokens [1,P], prompt mel [1,2P,80], embedding [1,192], tokens."""

    prompt: torch.Tensor
    feat: torch.Tensor
    embedding: torch.Tensor
    tokens: torch.Tensor  # [1, N]: the speech tokens the request will have, a prefix per call

    @property
    def prompt_frames(self) -> int:
        return self.feat.size(1)

    def frames(self, n: int) -> int:
        """Frames of a non-final call on the first n tokens, prompt included."""
        return 2 * (self.prompt.size(1) + n - LOOKAHEAD)


def voice(prompt_tokens: int, seed: int, tokens: int = 300) -> Voice:
    gen = torch.Generator().manual_seed(seed)
    return Voice(
        torch.randint(0, 6561, (1, prompt_tokens), generator=gen),
        torch.randn(1, 2 * prompt_tokens, 80, generator=gen),
        torch.randn(1, 192, generator=gen),
        torch.randint(0, 6561, (1, tokens), generator=gen),
    )


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad [1, L, ...] rows to the longest and stack them."""
    out = rows[0].new_zeros((len(rows), max(r.size(1) for r in rows), *rows[0].shape[2:]))
    for i, r in enumerate(rows):
        out[i, : r.size(1)] = r[0]
    return out


def run(
    voices: list[Voice],
    counts: list[int],
    caches: Sequence[DiTCache] | None = None,
    finalize: bool = False,
    family: str = "cosyvoice3",
    flow: Flow | None = None,
) -> torch.Tensor:
    """One padded flow call: row i on the first counts[i] tokens of voices[i] -> generated mel [B,80,T];
    by the family's tiny flow, or by ``flow`` (another solver around it)."""
    batch = FlowBatch(
        token=_stack([v.tokens[:, :n] for v, n in zip(voices, counts)]),
        token_len=torch.tensor(counts),
        prompt_token=_stack([v.prompt for v in voices]),
        prompt_token_len=torch.tensor([v.prompt.size(1) for v in voices]),
        prompt_feat=_stack([v.feat for v in voices]),
        prompt_feat_len=torch.tensor([v.prompt_frames for v in voices]),
        embedding=torch.cat([v.embedding for v in voices]),
    )
    return (flow or tiny_flow(family)).inference(
        batch, streaming=not finalize, finalize=finalize, caches=caches
    )


@families
def test_streamed_calls_reusing_frames_emit_what_recomputing_emits(family: str) -> None:
    v = voice(13, seed=0)  # 26 prompt frames: the speech starts inside the first chunk
    cache, emitted = CACHES[family](), 0  # generated frames emitted so far
    # frames 60, 102, 146, 200, 300, 422: calls ending inside a chunk, on its end, hops across several
    for n in (20, 41, 63, 90, 140, 201):
        start, queried = cache.frames, cache.queried
        want, got = run([v], [n], family=family), run([v], [n], [cache], family=family)
        assert got.shape == want.shape
        assert start <= v.prompt_frames + emitted  # what this call emits lies in its window
        torch.testing.assert_close(got[..., emitted:], want[..., emitted:], atol=1e-4, rtol=0)
        assert not got[..., : max(start - v.prompt_frames, 0)].any()  # before the window: not computed
        total = v.frames(n)
        assert (cache.frames, cache.queried - queried) == (total // CHUNK * CHUNK, total - start)
        emitted = want.size(2)
    assert cache.calls == 6 and cache.queried < sum(v.frames(n) for n in (20, 41, 63, 90, 140, 201)) / 2
    with pytest.raises(ValueError, match="non-final"):  # the final call has full attention: no reuse
        run([v], [230], [cache], finalize=True, family=family)


@families
def test_a_voices_prompt_chunks_carry_over_exactly_to_another_request_of_that_voice(family: str) -> None:
    """The premise of keeping a voice's prompt frames across its requests (BENCHMARKS, "Not measured yet"):
    the prompt's complete chunks before the look-ahead of its first speech token, [0, F_v) with F_v =
    (2 (P - look-ahead) // chunk) x chunk, depend on the voice alone, so a request's first call run from
    another request's cache cut there (and holding its state there) emits what recomputing emits; a chunk
    further, the other request's speech has reached the frames."""
    flow, p = tiny_flow(family), 40
    a, other = voice(p, seed=0, tokens=60), voice(p, seed=5, tokens=60)
    b = Voice(a.prompt, a.feat, a.embedding, other.tokens)  # the same voice, other speech
    voice_frames = 2 * (p - LOOKAHEAD) // CHUNK * CHUNK
    want = run([b], [30], family=family, flow=flow)
    for n, exact in ((12, True), (20, False)):  # a's first call ends at the voice's frames, then a chunk on
        donor = CACHES[family]()
        run([a], [n], [donor], family=family, flow=flow)
        assert donor.frames == voice_frames + (0 if exact else CHUNK)
        got = run([b], [30], [copy.deepcopy(donor)], family=family, flow=flow)
        assert got.shape == want.shape
        error = (got - want).abs().max().item()
        assert error < 1e-4 if exact else error > 1e-2, (n, error)


@families
def test_a_batch_with_different_cache_boundaries_equals_each_row_recomputed_alone(family: str) -> None:
    check_a_batch_with_different_boundaries(family, [CACHES[family](), CACHES[family]()])


def check_a_batch_with_different_boundaries(family: str, caches: Sequence, flow: Flow | None = None) -> None:
    """Two rows whose caches end at different frames, in padded batches, emit what each row recomputed
    alone emits (the caches: ``flow``'s kind, or the family's eager ones; test_dit_pages shares this)."""
    voices = [voice(13, seed=1), voice(31, seed=2)]  # 26 and 62 prompt frames
    run(voices[:1], [90], caches[:1], family=family, flow=flow)  # row 0 runs ahead: 200 frames cached
    emitted = [voices[0].frames(90) - voices[0].prompt_frames, 0]
    starts = []
    for counts in ((100, 20), (130, 60), (133, 95)):
        starts.append([c.frames for c in caches])
        got = run(voices, list(counts), caches, family=family, flow=flow)
        for i, (v, n) in enumerate(zip(voices, counts)):
            want = run([v], [n], family=family)
            end = want.size(2)
            torch.testing.assert_close(
                got[i : i + 1, :, emitted[i] : end], want[..., emitted[i] :], atol=1e-4, rtol=0
            )
            assert not got[i, :, end:].any()  # the shorter row's padding stays zero
            emitted[i] = end
    # each row started its window at its own boundary, the first row-1 call from 0
    assert starts == [[200, 0], [200, 50], [250, 150]]
    assert [c.frames for c in caches] == [250, 200]


def test_a_call_that_adds_no_frames_is_refused() -> None:
    v, cache = voice(13, seed=3), DiTCache()
    run([v], [90], [cache])  # 200 frames, all finished
    with pytest.raises(ValueError, match="add none"):
        run([v], [90], [cache])
    assert cache.frames == 200 and cache.calls == 1


@families
def test_a_full_budget_stops_a_cache_growing_and_the_audio_stays_exact(family: str) -> None:
    v, budget = voice(13, seed=4), ReuseBudget(2**40)
    cache, emitted = CACHES[family](budget), 0
    for n in (20, 41, 90, 140):  # 60 frames (50 kept), then 102, 182, 282
        want, got = run([v], [n], family=family), run([v], [n], [cache], family=family)
        torch.testing.assert_close(got[..., emitted:], want[..., emitted:], atol=1e-4, rtol=0)
        emitted = want.size(2)
        budget.limit = budget.held  # full after the first call: the cache may not grow
    assert cache.frames == 50 and cache.calls == 4  # every later call reused the 50 frames (v2: and states)
    assert budget.held == cache.nbytes > 0
    cache.clear()
    assert budget.held == 0


def test_a_cache_dropped_without_its_final_call_gives_its_bytes_back() -> None:
    budget = ReuseBudget(2**40)
    cache = DiTCache(budget)
    run([voice(13, seed=5)], [41], [cache])
    assert budget.held > 0
    del cache  # a cancelled request's Utterance goes away
    gc.collect()
    assert budget.held == 0
