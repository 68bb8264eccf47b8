"""Repetition-aware sampling (RAS, cosyvoice/utils/common.py ``ras_sampling``), batched, per-request seeded.

The reference semantics (spec 5.2): nucleus over the descending-sorted softmax keeps entry i iff the mass
before it is < top_p and i < top_k (so the entry that crosses top_p is kept); one draw over the kept,
unnormalised probabilities. If the drawn id occurs at least ``win_size * tau_r`` times in the last
``win_size`` generated ids, it is excluded (-inf) and one id is drawn from the softmax of the full
vocabulary (the post-2026-02 reference, which can no longer re-draw the repeated id).

Draws use inverse-CDF sampling with uniforms from each request's own CPU ``torch.Generator`` (two per
step, whether or not the fallback fires), so a request's tokens depend only on its seed and its logits:
not on the batch it shares, nor on the device, nor on the backend (native and vLLM call the same code).
"""

from __future__ import annotations

import functools
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
    fallbacks: int = 0  # how often RAS rejected a draw (statistics and tests)

    @classmethod
    def seeded(cls, seed: int, min_len: int, max_len: int, stop_ids: Sequence[int]) -> SamplerState:
        return cls(torch.Generator().manual_seed(seed), min_len, max_len, frozenset(stop_ids))

    def finished(self, token: int) -> bool:
        return token in self.stop_ids or len(self.history) >= self.max_len


def nucleus_keep(sorted_probs: torch.Tensor, top_p: float, top_k: int) -> int:
    """How many of the descending-sorted probabilities [K] the nucleus keeps (>= 1)."""
    mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
    return max(1, min(top_k, int((mass_before < top_p).sum())))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative ``weights`` [B, K] given uniforms ``u`` [B] in [0, 1)."""
    cdf = weights.cumsum(-1)
    target = u.unsqueeze(-1) * cdf[:, -1:]
    return (cdf <= target).sum(-1).clamp(max=weights.shape[-1] - 1)


def _mask_stops(logp: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """Forbid every stop id before ``min_len`` (one masked_fill for the whole batch).

    The reference HF path masks only index ``speech_token_size`` (v2 eos, but v3 *sos*), leaving v3's real
    eos free; we mask all stop ids, as its vLLM path does (min_tokens).
    """
    early = [len(s.history) < s.min_len for s in states]
    if not any(early):
        return logp
    vocab = logp.shape[-1]
    if all(s.stop_ids == states[0].stop_ids for s in states):  # the usual case: one model, one stop set
        stops = torch.tensor(early)[:, None] & _stop_row(states[0].stop_ids, vocab)[None]
    else:
        stops = torch.stack([_stop_row(s.stop_ids, vocab) & e for s, e in zip(states, early)])
    return logp.masked_fill(stops.to(logp.device, non_blocking=True), -math.inf)


@functools.lru_cache(maxsize=16)
def _stop_row(stop_ids: frozenset[int], vocab: int) -> torch.Tensor:
    """[vocab] bool, True at the stop ids (built once per stop set)."""
    row = torch.zeros(vocab, dtype=torch.bool)
    row[sorted(i for i in stop_ids if i < vocab)] = True
    return row


def _window(states: Sequence[SamplerState], win: int, device: torch.device) -> torch.Tensor:
    """The last ``win`` ids of every history, left-padded with -1: [B, win]."""
    rows = [([-1] * win + s.history[-win:])[-win:] for s in states]
    return torch.tensor(rows, device=device)


def sample_step(logp: torch.Tensor, states: Sequence[SamplerState], cfg: SamplingConfig) -> list[int]:
    """One RAS step for a batch: log-probs (or logits) [B, V] on any device -> one id per request."""
    u = torch.stack([torch.rand(2, generator=s.generator) for s in states]).to(logp.device)  # [B, 2]
    logp = _mask_stops(logp.float(), states)
    probs = logp.softmax(-1)
    top_p, top_i = probs.topk(min(cfg.top_k, probs.shape[-1]), dim=-1)  # sorted descending
    keep = (top_p.cumsum(-1) - top_p) < cfg.top_p
    keep[:, 0] = True
    pick = top_i.gather(1, _inverse_cdf(top_p * keep, u[:, 0]).unsqueeze(1)).squeeze(1)  # [B]
    repeats = (_window(states, cfg.win_size, logp.device) == pick.unsqueeze(1)).sum(1)
    refuse = repeats >= cfg.win_size * cfg.tau_r
    fallback = logp.scatter(1, pick.unsqueeze(1), -math.inf).softmax(-1)
    redraw = _inverse_cdf(fallback, u[:, 1])
    out, fell_back = torch.stack([torch.where(refuse, redraw, pick), refuse.long()]).tolist()  # one sync
    for state, tok, fell in zip(states, out, fell_back):
        state.history.append(tok)
        state.fallbacks += int(fell)
    return out
