"""RAS sampler: nucleus semantics, fallback firing exactly on repeats, stop masking, seeded determinism."""

import pytest
import torch

from engine.config import SamplingConfig
from engine.lm.sampling import SamplerState, nucleus_mask, sample_step, token_limits

CFG = SamplingConfig()


def logp_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def draw(lp: torch.Tensor, state: SamplerState, cfg: SamplingConfig = CFG) -> int:
    return sample_step(lp, [state], cfg)[0]


def test_nucleus_keeps_the_entry_that_crosses_top_p():
    # 0.5 + 0.25 = 0.75 < 0.8, so the third entry (which crosses 0.8) is kept too, the fourth is not.
    assert nucleus_mask(torch.tensor([0.5, 0.25, 0.15, 0.1]), 0.8).tolist() == [True, True, True, False]
    assert nucleus_mask(torch.tensor([0.9, 0.1]), 0.8).tolist() == [True, False]
    assert int(nucleus_mask(torch.full((100,), 0.01), 0.8).sum()) == 80  # top_k caps it at 25 (below)


def test_token_limits_follow_ratios():
    assert token_limits(8, CFG) == (16, 160)


def test_draws_stay_inside_the_nucleus_with_the_right_frequencies():
    state = SamplerState.seeded(0, 0, 10_000, [99])
    lp = logp_of([0.5, 0.25, 0.15, 0.1] + [0.0] * 30)
    cfg = SamplingConfig(win_size=1, tau_r=1.0, top_k=4)
    counts = torch.zeros(4)
    for _ in range(3000):
        state.history.clear()
        counts[draw(lp, state, cfg)] += 1
    assert counts[3] == 0
    # kept mass 0.9 renormalised: 0.556 / 0.278 / 0.167
    assert torch.allclose(counts[:3] / 3000, torch.tensor([0.556, 0.278, 0.167]), atol=0.03)


def test_top_k_caps_the_nucleus():
    state = SamplerState.seeded(1, 0, 10_000, [])
    lp = torch.full((1, 100), -4.6)  # uniform: top_p alone would keep 80 entries
    seen = set()
    for _ in range(500):
        state.history.clear()
        seen.add(draw(lp, state))
    assert len(seen) <= CFG.top_k and len(seen) > 15


def test_fallback_fires_iff_the_draw_repeats_within_the_window():
    lp = logp_of([0.97, 0.01, 0.01, 0.01])  # nucleus keeps only id 0
    state = SamplerState.seeded(1, 0, 1000, [])
    state.history = [3, 2, 1]  # id 0 not in the window: no fallback
    assert draw(lp, state) == 0 and state.fallbacks == 0
    for _ in range(50):  # id 0 now in the window: the fallback fires and never re-draws 0
        assert draw(lp, state) != 0
        state.history[-1] = 0
    assert state.fallbacks == 50


def test_fallback_ignores_ids_older_than_the_window():
    lp = logp_of([0.97, 0.01, 0.01, 0.01])
    state = SamplerState.seeded(2, 0, 1000, [])
    state.history = [0] + [1] * CFG.win_size  # id 0 just left the 10-token window
    assert draw(lp, state) == 0 and state.fallbacks == 0


def test_stop_ids_are_never_drawn_before_min_len():
    lp = logp_of([0.05, 0.9, 0.05])
    state = SamplerState.seeded(0, 30, 100, [1])
    assert all(draw(lp, state, SamplingConfig(win_size=1, tau_r=1.0)) != 1 for _ in range(30))
    assert draw(lp, state, SamplingConfig(win_size=1, tau_r=1.0)) == 1  # min_len reached: allowed


def test_same_seed_same_tokens_and_batch_rows_are_independent():
    torch.manual_seed(0)
    lp = torch.randn(2, 50).log_softmax(-1)
    runs = []
    for _ in range(2):
        states = [SamplerState.seeded(7, 0, 100, []), SamplerState.seeded(8, 0, 100, [])]
        runs.append([sample_step(lp, states, CFG) for _ in range(20)])
    assert runs[0] == runs[1]
    alone = SamplerState.seeded(7, 0, 100, [])
    assert [draw(lp[:1], alone) for _ in range(20)] == [r[0] for r in runs[0]]
    other = SamplerState.seeded(9, 0, 100, [])
    assert [draw(lp[:1], other) for _ in range(20)] != [r[0] for r in runs[0]]


def test_finished_on_stop_or_max_len():
    state = SamplerState.seeded(0, 0, 3, [5])
    assert state.finished(5)
    state.history = [1, 2, 3]
    assert state.finished(1)


@pytest.mark.parametrize("bad", [{"top_p": 0.0}, {"top_k": 0}, {"tau_r": 2.0}])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


def _peaky_logits(steps: int, batch: int, vocab: int = 40) -> list[torch.Tensor]:
    """Logit rows concentrated on few ids, so draws repeat and the RAS fallback fires often."""
    g = torch.Generator().manual_seed(3)
    return [torch.randn(batch, vocab, generator=g) * 4 for _ in range(steps)]


def _forced_ids(forced: torch.Tensor) -> list[int]:
    assert ((forced == 0).sum(1) == 1).all() and (forced.isinf().sum(1) == forced.shape[1] - 1).all()
    return forced.argmax(1).tolist()


def test_device_ras_draws_the_same_ids_as_the_host_sampler():
    from engine.lm.sampling import DeviceRAS

    seeds, stops, min_len = [11, 12, 13], [0, 1], 5
    host = [SamplerState.seeded(s, min_len, 1000, stops) for s in seeds]
    dev = DeviceRAS(40, torch.device("cpu"), CFG, rows=4, steps=64)
    for row, s in enumerate(seeds):
        dev.add(row, s, min_len, stops, greedy=False)
    for logits in _peaky_logits(40, 3):
        want = sample_step(logits, host, CFG)
        assert _forced_ids(dev.step(logits.clone())) == want
    assert sum(h.fallbacks for h in host) > 0  # the fallback path was exercised
    assert all(0 not in h.history[:min_len] and 1 not in h.history[:min_len] for h in host)


def test_device_ras_rows_survive_moves_and_preemption():
    from engine.lm.sampling import DeviceRAS

    logits = _peaky_logits(30, 2)
    ref = DeviceRAS(40, torch.device("cpu"), CFG, rows=4, steps=64)
    ref.add(0, 5, 0, [], False)
    ref.add(1, 6, 0, [], False)
    want = [_forced_ids(ref.step(x.clone())) for x in logits]

    dev = DeviceRAS(40, torch.device("cpu"), CFG, rows=4, steps=64)
    dev.add(0, 5, 0, [], False)
    dev.add(1, 6, 0, [], False)
    got = [_forced_ids(dev.step(x.clone())) for x in logits[:10]]
    dev.move(0, 1, swap=True)  # vLLM swaps the two requests' rows: their logits swap too
    got += [_forced_ids(dev.step(x.flip(0).clone()))[::-1] for x in logits[10:20]]
    dev.move(1, 0, swap=True)
    history = [g[0] for g in got]  # request 0 is preempted and resumes with the ids it already has
    dev.remove(0)
    dev.add(0, 5, 0, [], False, history=history)
    got += [_forced_ids(dev.step(x.clone())) for x in logits[20:]]
    assert got == want


def test_device_ras_leaves_other_rows_alone_and_honours_greedy():
    from engine.lm.sampling import DeviceRAS

    dev = DeviceRAS(40, torch.device("cpu"), CFG, rows=4, steps=8)
    dev.add(1, 0, 3, [7], greedy=True)
    logits = torch.zeros(3, 40)
    logits[:, 7] = 10.0
    logits[:, 9] = 5.0
    out = dev.step(logits.clone())
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert _forced_ids(out[1:2]) == [9]  # argmax with the stop id 7 masked before min_len
