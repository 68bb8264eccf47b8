"""bench/soak_mix.py: the open-loop soak's schedule, and its clients against a real tiny v3 engine on the
CPU: every bad request gets its documented error, a client that leaves mid-stream is freed, a saved voice
serves."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from bench.load import prompt_audio
from bench.soak_mix import (
    BAD,
    BAD_CASES,
    GOOD,
    LEAVER,
    VOICE,
    Arrival,
    Client,
    MixConfig,
    schedule,
    send,
)
from bench.soak_open import save_voices
from engine.config import EngineConfig, Limits
from engine.demo.make_model import build_model_dir
from engine.serving.engine import TTSEngine

OWNER = "soak-test"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TTSEngine]:
    root = tmp_path_factory.mktemp("soak_mix")
    model = build_model_dir(root / "model", "cosyvoice3", "tiny")
    limits = Limits(max_concurrency=4, max_queue=4)
    cfg = EngineConfig(
        model=str(model), device="cpu", backend="native", voices_dir=str(root / "voices"), limits=limits
    )
    eng = TTSEngine.load(cfg)
    eng.ready = True
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: TTSEngine) -> Client:
    voices = save_voices(engine, 1, OWNER)
    return Client(engine, prompt_audio(), tuple(voices), OWNER, time.monotonic())


def test_schedule_is_seeded_and_mixes_the_kinds_at_their_shares():
    cfg = MixConfig(rate=20.0, minutes=5.0, tokens=250, leave_fraction=0.10, bad_fraction=0.05, seed=3)
    arrivals = schedule(cfg)
    assert arrivals == schedule(cfg) and arrivals != schedule(MixConfig(20.0, 5.0, seed=4))
    assert len(arrivals) == cfg.requests == 6000
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(arrivals))
    assert arrivals[-1].at_s == pytest.approx(300.0, rel=0.1)  # 6000 Poisson arrivals at 20/s
    kinds = Counter(a.kind for a in arrivals)
    assert kinds[BAD] / 6000 == pytest.approx(0.05, abs=0.012)
    assert kinds[LEAVER] / 6000 == pytest.approx(0.10, abs=0.015)
    assert kinds[VOICE] / (kinds[GOOD] + kinds[VOICE]) == pytest.approx(0.05, abs=0.012)
    assert {a.case for a in arrivals if a.kind == BAD} == {c.name for c in BAD_CASES}
    assert all(0.1 <= a.leave_at <= 0.9 for a in arrivals if a.kind == LEAVER)
    assert {a.case for a in arrivals if a.kind != BAD} == {""}
    assert 125 <= min(a.tokens for a in arrivals) < max(a.tokens for a in arrivals) <= 375


@pytest.mark.parametrize(
    "kw",
    [{"rate": 0.0}, {"minutes": 0.0}, {"leave_fraction": 0.7, "bad_fraction": 0.5}, {"bad_fraction": -0.1},
     {"spread": 1.0}],
    ids=str,
)  # fmt: skip
def test_bad_mix_settings_are_refused(kw):
    with pytest.raises(ValueError):
        MixConfig(**{"rate": 1.0, "minutes": 1.0, **kw})


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.name)
async def test_every_bad_request_gets_its_documented_error(client, case):
    before = client.engine.stats()
    out = await send(client, Arrival(7, 0.0, 30, BAD, case=case.name))
    assert out.as_expected is True and not out.refused, out.error
    assert out.error is not None and out.audio_s == 0 and out.ttfa_ms is None
    stats = client.engine.stats()
    assert (stats.active_streams, stats.queued, stats.completed) == (0, 0, before.completed)


async def test_a_client_that_leaves_mid_stream_is_freed_and_the_engine_keeps_serving(client):
    engine = client.engine
    before = engine.stats()
    out = await send(client, Arrival(1, 0.0, 150, LEAVER, leave_at=0.3))  # leaves after ~1.8 of 6 s
    assert out.error is None and out.freed is True
    assert 0.3 * 150 / 25 <= out.audio_s < 150 / 25 and out.ttfa_ms is not None
    after = engine.stats()
    assert after.cancelled == before.cancelled + 1 and after.completed == before.completed
    assert (after.active_streams, after.queued) == (0, 0)
    good = await send(client, Arrival(2, 0.0, 30, GOOD))
    assert good.error is None and good.audio_s > 0 and good.freed is None


async def test_a_leaver_whose_stream_ends_first_did_not_leave(client):
    out = await send(client, Arrival(3, 0.0, 10, LEAVER, leave_at=5.0))  # past its end: it reads it all
    assert out.error is None and out.freed is None and out.audio_s > 0


async def test_a_request_in_a_saved_voice_is_served(client):
    assert client.voices and all(isinstance(v, str) for v in client.voices)
    out = await send(client, Arrival(4, 0.0, 30, VOICE))
    assert out.error is None and out.audio_s > 0 and out.kind == VOICE


def test_bad_cases_build_what_they_name():
    prompt = prompt_audio()
    built = {}
    for case in BAD_CASES:
        try:
            built[case.name] = case.build(prompt)
        except ValueError:  # the request contract refuses it itself
            built[case.name] = None
    assert built["bad speed"] is None
    assert len(built["text too long"].text) > 10_000
    short, long_ = built["prompt too short"].prompt_audio, built["prompt too long"].prompt_audio
    assert short is not None and long_ is not None
    assert short[0].size / short[1] < 1.0 < 30.0 < long_[0].size / long_[1]
