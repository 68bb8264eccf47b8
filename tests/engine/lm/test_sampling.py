"""RAS sampler: nucleus semantics, fallback firing exactly on repeats, stop masking, seeded determinism."""

import math

import pytest
import torch

from engine.config import SamplingConfig
from engine.lm.sampling import SamplerState, mask_stops, nucleus_keep, ras_sample, sample_step, token_limits

CFG = SamplingConfig()


def logp_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_nucleus_keeps_the_entry_that_crosses_top_p():
    # 0.5 + 0.25 = 0.75 < 0.8, so the third entry (which crosses 0.8) is kept too, the fourth is not.
    assert nucleus_keep(torch.tensor([0.5, 0.25, 0.15, 0.1]), 0.8, 25) == 3
    assert nucleus_keep(torch.tensor([0.9, 0.1]), 0.8, 25) == 1
    assert nucleus_keep(torch.full((100,), 0.01), 0.8, 25) == 25


def test_token_limits_follow_ratios():
    assert token_limits(8, CFG) == (16, 160)


def test_draws_stay_inside_the_nucleus():
    state = SamplerState.seeded(0, 0, 10_000, [99])
    lp = logp_of([0.5, 0.25, 0.15, 0.1])
    cfg = SamplingConfig(win_size=1, tau_r=1.0)
    seen = set()
    for _ in range(300):
        state.history.clear()
        seen.add(ras_sample(lp, state, cfg))
    assert seen == {0, 1, 2}


def test_fallback_fires_iff_the_draw_repeats_within_the_window():
    lp = logp_of([0.97, 0.01, 0.01, 0.01])  # nucleus keeps only id 0
    state = SamplerState.seeded(1, 0, 1000, [])
    state.history = [3, 2, 1]  # id 0 not in the window: no fallback
    assert ras_sample(lp, state, CFG) == 0 and state.fallbacks == 0
    # id 0 now in the window: the fallback fires and must not re-draw 0
    for _ in range(50):
        assert ras_sample(lp, state, CFG) != 0
        state.history[-1] = 0  # keep 0 inside the window
    assert state.fallbacks == 50


def test_fallback_ignores_ids_older_than_the_window():
    lp = logp_of([0.97, 0.01, 0.01, 0.01])
    state = SamplerState.seeded(2, 0, 1000, [])
    state.history = [0] + [1] * CFG.win_size  # id 0 just left the 10-token window
    assert ras_sample(lp, state, CFG) == 0 and state.fallbacks == 0


def test_stop_ids_are_masked_before_min_len_only():
    state = SamplerState.seeded(0, 2, 100, [1, 2])
    lp = logp_of([0.1, 0.8, 0.1])
    assert mask_stops(lp, state)[1:].isinf().all()
    state.history = [0, 0]
    assert not mask_stops(lp, state).isinf().any()


def test_same_seed_same_tokens_and_batch_rows_are_independent():
    torch.manual_seed(0)
    lp = torch.randn(2, 50).log_softmax(-1)
    runs = []
    for _ in range(2):
        states = [SamplerState.seeded(7, 0, 100, []), SamplerState.seeded(8, 0, 100, [])]
        runs.append([sample_step(lp, states, CFG) for _ in range(20)])
    assert runs[0] == runs[1]
    alone = SamplerState.seeded(7, 0, 100, [])
    assert [sample_step(lp[:1], [alone], CFG)[0] for _ in range(20)] == [r[0] for r in runs[0]]


def test_finished_on_stop_or_max_len():
    state = SamplerState.seeded(0, 0, 3, [5])
    assert state.finished(5)
    state.history = [1, 2, 3]
    assert state.finished(1)


@pytest.mark.parametrize("bad", [{"top_p": 0.0}, {"top_k": 0}, {"tau_r": 2.0}])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


def test_masked_row_is_never_drawn():
    state = SamplerState.seeded(3, 5, 100, [0])
    lp = logp_of([0.9, 0.05, 0.05])
    draws = {
        ras_sample(mask_stops(lp, state), state, SamplingConfig(win_size=1, tau_r=1.0)) for _ in range(3)
    }
    assert 0 not in draws and not math.isnan(lp.sum())
