"""A voice's prompt pages kept across its requests (engine.flow.voice_pages): a later request of the voice
starts its first call after them and emits what recomputing emits, never writes them, and the pool counts
their holders. The tiny flows through the graphed solver with its page pool, capture emulated on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.flow.dit_pages import PagedCache, PageLayout, PagePool
from engine.flow.voice_pages import VoicePages, voice_frames, voice_key
from tests.engine.flow.test_dit_cache import CHUNK, LOOKAHEAD, Voice, families, run, voice
from tests.engine.flow.test_dit_pages import paged

P = 40  # prompt tokens: 80 frames, of which the voice's are [0, 50)


def key_of(v: Voice) -> bytes:
    return voice_key(v.prompt[0].numpy(), v.feat[0].numpy(), v.embedding[0].numpy())


def same_voice(v: Voice, seed: int) -> Voice:
    """Another request of ``v``'s voice: its prompt, other speech tokens."""
    return Voice(v.prompt, v.feat, v.embedding, voice(P, seed=seed, tokens=60).tokens)


@families
def test_a_later_request_of_a_kept_voice_starts_after_its_prompt_and_emits_what_recomputing_emits(
    monkeypatch, family
):
    flow, graphed = paged(monkeypatch, family=family)
    voices, pool = graphed.voices, graphed.pool
    assert voices is not None and pool is not None
    a = voice(P, seed=0, tokens=60)
    key, frames = key_of(a), voice_frames(P, LOOKAHEAD, CHUNK)
    assert frames == 50
    donor = graphed.frame_cache(None)  # type: ignore[arg-type]
    assert not voices.start(key, donor)  # not kept yet: a request of a new voice starts at frame 0
    run([a], [30], [donor], flow=flow)  # 134 frames: chunks 0 and 1 kept by the request
    assert voices.keep(key, donor, frames) and not voices.keep(key, donor, frames)
    kept = voices.find(key)
    assert kept is not None and kept.pages == (donor.pages[0],) and kept.frames == 50
    written = pool.kv[:, kept.pages[0]].clone(), pool.x[:, kept.pages[0]].clone()
    for seed in (5, 6):
        b, later = same_voice(a, seed), graphed.frame_cache(None)  # type: ignore[arg-type]
        assert voices.start(key, later) and later.frames == 50
        got, want = run([b], [30], [later], flow=flow), run([b], [30], family=family)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert later.queried == b.frames(30) - 50  # the voice's 50 frames not computed again
        page = kept.pages[0]  # never written by the later request
        assert torch.equal(pool.kv[:, page], written[0]) and torch.equal(pool.x[:, page], written[1])
        later.clear()
    donor.clear()
    assert pool.held == 1  # the voice's page, nobody else's
    voices.clear()
    assert pool.held == 0


@families
def test_another_voice_or_a_prompt_too_short_keeps_nothing_of_the_first(monkeypatch, family):
    flow, graphed = paged(monkeypatch, family=family)
    voices = graphed.voices
    assert voices is not None
    a = voice(P, seed=0, tokens=60)
    donor = graphed.frame_cache(None)  # type: ignore[arg-type]
    run([a], [30], [donor], flow=flow)
    assert voices.keep(key_of(a), donor, voice_frames(P, LOOKAHEAD, CHUNK))
    other = graphed.frame_cache(None)  # type: ignore[arg-type]
    assert not voices.start(key_of(voice(P, seed=1)), other) and other.frames == 0
    short = voice(26, seed=2, tokens=60)  # 52 prompt frames: the look-ahead reaches into chunk 0
    assert voice_frames(26, LOOKAHEAD, CHUNK) == 0
    cache = graphed.frame_cache(None)  # type: ignore[arg-type]
    run([short], [30], [cache], flow=flow)
    assert not voices.keep(key_of(short), cache, 0) and voices.pages == 1
    fresh = graphed.frame_cache(None)  # type: ignore[arg-type]
    assert not voices.keep(key_of(voice(P, seed=3)), fresh, 50)  # its cache holds nothing yet


def tiny_pool(pages: int) -> PagePool:
    cpu = torch.device("cpu")
    return PagePool(PageLayout(1, 1, 1, 1, 1, CHUNK, 0, pages, torch.float32, torch.float32, cpu))


def committed(pool: PagePool, chunks: int = 2) -> PagedCache:
    """A request's cache after a committed call of ``chunks`` whole chunks."""
    cache = PagedCache(pool)
    cache.reserve(chunks * CHUNK, 2 * chunks)
    cache.commit(chunks * CHUNK, chunks * CHUNK)
    return cache


def test_the_least_recently_used_voices_go_first_and_their_pages_when_nobody_holds_them():
    pool = tiny_pool(8)
    voices = VoicePages(pool, max_pages=2, idle_s=0.0)  # plain LRU
    caches = []
    for name in (b"a", b"b", b"c"):
        cache = committed(pool)
        assert voices.keep(name, cache, CHUNK)
        caches.append(cache)
        if name == b"b":
            assert voices.find(b"a") is not None  # a used again: b is now the least recent
    assert voices.find(b"b") is None and voices.find(b"a") is not None and voices.pages == 2
    assert pool.held == 6  # every cache still holds its two pages
    for cache in caches:
        cache.clear()
    assert pool.held == 2  # a's and c's first pages, held by their voices


def test_a_new_voice_takes_only_the_place_of_one_idle_for_idle_s():
    clock = [0.0]
    pool = tiny_pool(16)
    voices = VoicePages(pool, max_pages=2, idle_s=60.0, clock=lambda: clock[0])
    assert voices.keep(b"a", committed(pool), CHUNK) and voices.keep(b"b", committed(pool), CHUNK)
    clock[0] = 59.0
    assert voices.find(b"b") is not None  # b used again; a idle since 0
    assert not voices.keep(b"c", committed(pool), CHUNK)  # a has been idle 59 s: nobody makes room
    assert voices.find(b"a") is not None and voices.find(b"c") is None and voices.pages == 2
    clock[0] = 200.0  # both idle now: the least recently used goes (b: a was found after it at 59 s)
    assert voices.keep(b"c", committed(pool), CHUNK)
    assert voices.find(b"b") is None and voices.find(b"a") is not None
    clock[0] = 230.0
    assert not voices.keep(b"d", committed(pool, 4), 4 * CHUNK)  # more pages than there are


def test_more_voices_in_turn_than_fit_keep_those_that_fit_where_plain_lru_keeps_none():
    """Voices recurring in turn, more than fit (the open-loop bench's 25): LRU evicts each one just before
    it comes back; waiting for an idle one keeps the first that fit, and their later requests start there."""

    def hits(idle_s: float) -> int:
        clock = [0.0]
        pool = tiny_pool(64)
        voices = VoicePages(pool, max_pages=4, idle_s=idle_s, clock=lambda: clock[0])
        found = 0
        for i in range(30):  # 10 voices in turn, one request a second, 3 rounds
            clock[0], key = float(i), bytes([i % 10])
            if voices.start(key, PagedCache(pool)):
                found += 1
                continue
            cache = committed(pool)
            voices.keep(key, cache, CHUNK)
            cache.clear()
        return found

    assert hits(0.0) == 0  # LRU: each voice evicted before its turn comes again
    assert hits(60.0) == 8  # the first 4 voices stay: found in rounds 2 and 3


def test_the_pool_refuses_to_share_or_take_back_a_page_nobody_holds():
    pool = tiny_pool(4)
    (page,) = pool.take(1)
    pool.share([page])
    pool.give([page])
    assert pool.held == 1
    pool.give([page])
    assert pool.held == 0
    with pytest.raises(ValueError, match="free page"):
        pool.give([page])
    with pytest.raises(ValueError, match="nobody holds"):
        pool.share([page])
    cache = PagedCache(pool)
    cache.reserve(CHUNK, 2)
    with pytest.raises(ValueError, match="used cache"):
        cache.adopt([page], CHUNK)


@families
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_kept_voices_later_request_stays_close_to_the_float32_recompute(family):
    """The GPU guard of kept voices: bf16 page windows in real CUDA graphs, a later request of a kept voice
    (its first call after the voice's page) against the eager float32 recompute of that request, as the
    frame reuse's own guard (test_dit_pages.py) measures it: the mel's RMS error over its std."""
    from engine.flow.cfm import FlowBatch
    from engine.flow.graphs import GraphedCFM
    from tests.engine.flow.test_dit_cache import tiny_flow

    dev = torch.device("cuda")
    flow = copy.deepcopy(tiny_flow(family)).to(dev)
    reference = copy.deepcopy(flow)
    graphed = GraphedCFM(flow.decoder, torch.bfloat16)
    assert graphed.enable_reuse(2**30, 800, dev) > 10 and graphed.voices is not None
    flow.decoder = graphed  # type: ignore[assignment]
    a = voice(P, seed=0, tokens=60)
    b = same_voice(a, seed=5)

    def call(v: Voice, cache: PagedCache | None, model) -> torch.Tensor:
        batch = FlowBatch(
            v.tokens[:, :30].to(dev), torch.tensor([30], device=dev), v.prompt.to(dev),
            torch.tensor([P], device=dev), v.feat.to(dev), torch.tensor([v.prompt_frames], device=dev),
            v.embedding.to(dev),
        )  # fmt: skip
        with torch.inference_mode():
            caches = None if cache is None else [cache]
            return model.inference(batch, streaming=True, finalize=False, caches=caches)

    donor = graphed.frame_cache(None)  # type: ignore[arg-type]
    call(a, donor, flow)
    assert graphed.voices.keep(key_of(a), donor, voice_frames(P, LOOKAHEAD, CHUNK))
    later = graphed.frame_cache(None)  # type: ignore[arg-type]
    assert graphed.voices.start(key_of(a), later) and later.frames == 50
    got, want = call(b, later, flow), call(b, None, reference)
    assert torch.isfinite(got).all() and got.shape == want.shape
    assert ((got - want).pow(2).mean().sqrt() / want.std()).item() < 0.05
