"""Repetition-aware sampling (RAS, cosyvoice/utils/common.py ``ras_sampling``) with per-request generators.

The reference semantics (spec 5.2): nucleus over the descending-sorted softmax keeps entry i iff the mass
before it is < top_p and i < top_k (so the entry that crosses top_p is kept); one multinomial draw over the
kept, unnormalised probabilities. If the drawn id occurs at least ``win_size * tau_r`` times in the last
``win_size`` generated ids, it is excluded (-inf) and one id is drawn from the softmax of the full
vocabulary (the post-2026-02 reference, which no longer can re-draw the repeated id).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.config import SamplingConfig


def token_limits(n_text_tokens: int, cfg: SamplingConfig) -> tuple[int, int]:
    """(min_len, max_len) speech tokens for ``n_text_tokens`` tts-text tokens (prompt text excluded)."""
    return int(n_text_tokens * cfg.min_token_text_ratio), int(n_text_tokens * cfg.max_token_text_ratio)


@dataclass
class SamplerState:
    """One request's sampler: its own RNG, its history (the RAS window) and its length limits."""

    generator: torch.Generator
    min_len: int
    max_len: int
    stop_ids: frozenset[int]
    history: list[int] = field(default_factory=list)
    fallbacks: int = 0  # how often RAS rejected a draw (for statistics and tests)

    @classmethod
    def seeded(cls, seed: int, min_len: int, max_len: int, stop_ids: Sequence[int]) -> SamplerState:
        return cls(torch.Generator().manual_seed(seed), min_len, max_len, frozenset(stop_ids))

    def finished(self, token: int) -> bool:
        return token in self.stop_ids or len(self.history) >= self.max_len


def mask_stops(logp: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """Forbid every stop id before ``min_len`` tokens.

    The reference HF path masks only index ``speech_token_size`` (v2 eos, but v3 *sos*), leaving v3's real
    eos free; we mask all stop ids, as its vLLM path does (min_tokens).
    """
    if len(state.history) >= state.min_len:
        return logp
    out = logp.clone()
    out[list(state.stop_ids)] = -math.inf
    return out


def nucleus_keep(sorted_probs: torch.Tensor, top_p: float, top_k: int) -> int:
    """How many of the descending-sorted probabilities the nucleus keeps (>= 1)."""
    mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
    return max(1, min(top_k, int((mass_before < top_p).sum())))


def ras_sample(logp: torch.Tensor, state: SamplerState, cfg: SamplingConfig) -> int:
    """Draw one id from a 1-D log-prob row (float32, CPU) and append it to the history."""
    probs = logp.softmax(0)
    sorted_probs, order = probs.sort(descending=True, stable=True)
    keep = nucleus_keep(sorted_probs, cfg.top_p, cfg.top_k)
    pick = int(order[torch.multinomial(sorted_probs[:keep], 1, True, generator=state.generator)])
    window = state.history[-cfg.win_size :]
    if window.count(pick) >= cfg.win_size * cfg.tau_r:
        state.fallbacks += 1
        masked = logp.clone()
        masked[pick] = -math.inf
        pick = int(torch.multinomial(masked.softmax(0), 1, True, generator=state.generator))
    state.history.append(pick)
    return pick


def sample_step(logp: torch.Tensor, states: Sequence[SamplerState], cfg: SamplingConfig) -> list[int]:
    """One decode step for a batch: ``logp`` [B, V] (any device) -> one id per request."""
    rows = logp.float().cpu()
    return [ras_sample(mask_stops(rows[i], s), s, cfg) for i, s in enumerate(states)]
