"""Flow frame reuse against recomputing, as a seeded property: many prompt, source and token lengths and
chunk schedules, both families, every mode, the eager caches and the CUDA-graph solver's page windows.

At token2wav's level the modes differ in two ways. The zero-shot-style modes (zero-shot, cross-lingual,
instruct, a saved voice) trim the prompt to 2 mel frames a token and feed tokens as the LM samples them;
voice conversion keeps the prompt's own mel length (spec §3.7: up to a few frames off 2 x its tokens) and
has every source token at once. Each case streams one or two requests through three workers (recomputing,
eager reuse, paged reuse) and checks that the reusing ones play what the recomputing one plays, and that
the chunks tile the whole-file call's frames (no frame repeated or skipped at a seam).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.checkpoint import LoadedModel, load_model
from engine.config import StreamConfig
from engine.demo.make_model import build_model_dir
from engine.flow.graphs import GraphedCFM
from engine.frontend import PromptFeatures
from engine.hub import validate_model_dir
from engine.request import Mode
from engine.serving.streaming import SAMPLES_PER_FRAME
from engine.serving.token2wav import Token2Wav, Utterance
from tests.engine.test_graph_cache import emulate_capture

CASES_PER_FAMILY = 10
LM_MODES = (Mode.ZERO_SHOT, Mode.CROSS_LINGUAL, Mode.INSTRUCT)  # a saved voice is zero-shot


@dataclass(frozen=True)
class Request:
    """One request's token2wav inputs: ``lag`` = 2 x prompt tokens - prompt mel frames (0: trimmed)."""

    mode: Mode
    prompt_tokens: int
    lag: int
    tokens: int
    seed: int

    def features(self, family: str) -> tuple[PromptFeatures, list[int]]:
        rng = np.random.default_rng(self.seed)
        frames = 2 * self.prompt_tokens - self.lag
        features = PromptFeatures(
            speech_tokens=rng.integers(0, 6561, self.prompt_tokens).astype(np.int32),
            speaker_embedding=rng.standard_normal(192).astype(np.float32),
            prompt_mel=rng.standard_normal((frames, 80)).astype(np.float32),
            num_samples=frames * SAMPLES_PER_FRAME,
            content_hash=f"case{self.seed}",
            family=family,
            trimmed=self.lag == 0,
        )
        return features, rng.integers(0, 6561, self.tokens).tolist()


@dataclass(frozen=True)
class Case:
    """Requests streamed together on one chunk schedule; ``buffered_s``: the audio their clients hold
    (adaptive hops merge chunks while it is at least ``hold_buffer_s``)."""

    requests: tuple[Request, ...]
    schedule: StreamConfig
    buffered_s: float


MODES = (Mode.VC, *LM_MODES)
SCHEDULES = ((False, False), (True, False), (False, True), (True, True))  # (fast_start, adaptive_hop)
VC_LAGS = (-1, 1, 2, -2, 3, 0)  # an untrimmed prompt's mel is ~2 frames a token, off by a few either way


def random_request(rng: random.Random, mode: Mode, lag: int, seed: int) -> Request:
    prompt = rng.choice((1, 2, rng.randint(3, 30), rng.randint(31, 60)))
    tokens = rng.choice((4, rng.randint(5, 40), rng.randint(41, 120), rng.randint(121, 200)))
    return Request(mode, prompt, min(lag, 2 * prompt - 1) if mode == Mode.VC else 0, tokens, seed)


def random_cases(family: str, n: int) -> list[Case]:
    """Every mode and schedule in turn (out of step with each other), random lengths; one case in three
    streams a second request beside the first."""
    rng, lags = random.Random(f"flow reuse {family}"), itertools.cycle(VC_LAGS)
    cases = []
    for i in range(n):
        modes = [MODES[(i + j) % len(MODES)] for j in range(2 if i % 3 == 2 else 1)]
        lags_now = [next(lags) if m == Mode.VC else 0 for m in modes]
        requests = tuple(
            random_request(rng, m, lag, 100 * i + j) for j, (m, lag) in enumerate(zip(modes, lags_now))
        )
        fast, adaptive = SCHEDULES[(i + i // len(MODES)) % len(SCHEDULES)]
        schedule = StreamConfig(
            fast_start=fast,
            adaptive_hop=adaptive,
            min_first_hop=rng.choice((5, 12)),
            max_token_hop=rng.choice((50, 100)),
        )
        cases.append(Case(requests, schedule, rng.choice((0.0, 5.0))))
    return cases


async def stream(t2w: Token2Wav, request: Request, case: Case) -> tuple[list[np.ndarray], Utterance]:
    """One request's streamed chunks: an LM mode's tokens arrive one by one, a VC source's all at once."""
    features, tokens = request.features(t2w.family)
    utt = t2w.utterance(features, seed=request.seed, stream=True, schedule=case.schedule)
    out: list[np.ndarray] = []
    if request.mode != Mode.VC:
        for token in tokens:
            utt.tokens.append(token)
            while (job := utt.planner.next_job(len(utt.tokens), False, case.buffered_s)) is not None:
                out.append(await t2w.run(utt, job))
    utt.tokens[:] = tokens
    while (job := utt.planner.next_job(len(tokens), True, case.buffered_s)) is not None:
        out.append(await t2w.run(utt, job))
    return out, utt


async def stream_together(t2w: Token2Wav, case: Case) -> list[tuple[list[np.ndarray], Utterance]]:
    """The case's requests at once: their chunks meet in the worker's batches."""
    return list(await asyncio.gather(*(stream(t2w, r, case) for r in case.requests)))


async def whole(t2w: Token2Wav, request: Request) -> np.ndarray:
    features, tokens = request.features(t2w.family)
    utt = t2w.utterance(features, seed=request.seed, stream=False)
    utt.tokens.extend(tokens)
    job = utt.planner.next_job(len(tokens), True)
    assert job is not None
    return await t2w.run(utt, job)


@dataclass
class Workers:
    plain: Token2Wav  # recomputes every frame of every call
    eager: Token2Wav  # DiTCache / UNetCache
    paged: Token2Wav  # GraphedCFM's page windows (capture emulated)


def paged_model(family: str, model_dir) -> LoadedModel:
    model = load_model(validate_model_dir(model_dir), torch.device("cpu"))
    graphed = GraphedCFM(model.flow.decoder)
    assert graphed.enable_reuse(2**30, 800, model.device) > 0
    model.flow.decoder = graphed  # type: ignore[assignment]
    return model


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def workers(request, tmp_path_factory) -> Iterator[Workers]:
    family = request.param
    model_dir = build_model_dir(tmp_path_factory.mktemp(family), family, "tiny")
    model = load_model(validate_model_dir(model_dir), torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:
        emulate_capture(mp)
        graphed = paged_model(family, model_dir)
        made = [
            Token2Wav(m.flow, m.hift, family, m.device, StreamConfig(), max_batch=2, flow_reuse=reuse)
            for m, reuse in ((model, False), (model, True), (graphed, True))
        ]
        try:
            assert [w.reuses_flow for w in made] == [False, True, True]
            yield Workers(*made)
        finally:
            for w in made:
                w.close()


def test_flow_reuse_streams_what_recomputing_streams_over_random_lengths_and_schedules(workers):
    family = workers.plain.family
    reused_calls = 0
    for case in random_cases(family, CASES_PER_FAMILY):
        plain = asyncio.run(stream_together(workers.plain, case))
        for kind in ("eager", "paged"):
            got = asyncio.run(stream_together(getattr(workers, kind), case))
            for (want, _), (chunks, utt) in zip(plain, got):
                assert len(chunks) == len(want), (kind, case)
                for a, b in zip(want, chunks):
                    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0, err_msg=f"{kind} {case}")
                cache = utt.flow_cache
                assert cache is not None and cache.calls == len(chunks) - 1, (kind, case)
                reused_calls += cache.calls
        for request, (want, _) in zip(case.requests, plain):
            # the chunks tile the whole-file call's frames: a seam neither repeats nor skips a frame
            assert sum(len(c) for c in want) == len(asyncio.run(whole(workers.plain, request))), case
    assert reused_calls >= CASES_PER_FAMILY  # the property ran through the caches, not around them


def test_the_random_cases_cover_every_mode_untrimmed_prompts_and_each_schedule():
    """The seeded cases reach what the property is about, for both families."""
    for family in ("cosyvoice2", "cosyvoice3"):
        cases = random_cases(family, CASES_PER_FAMILY)
        requests = [r for c in cases for r in c.requests]
        assert {r.mode for r in requests} == {Mode.VC, *LM_MODES}
        assert {r.lag for r in requests if r.mode == Mode.VC} >= {-1, 1, 2}
        assert any(len(c.requests) == 2 for c in cases)
        assert {(c.schedule.fast_start, c.schedule.adaptive_hop) for c in cases} == {
            (a, b) for a in (True, False) for b in (True, False)
        }
        assert min(r.prompt_tokens for r in requests) <= 2 and max(r.tokens for r in requests) > 120
