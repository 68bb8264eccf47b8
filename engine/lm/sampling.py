"""Repetition-aware sampling (RAS, cosyvoice/utils/common.py ``ras_sampling``), batched, per-request seeded.

The reference semantics (spec 5.2): nucleus over the descending-sorted softmax keeps entry i iff the mass
before it is < top_p and i < top_k (so the entry that crosses top_p is kept); one draw over the kept,
unnormalised probabilities. If the drawn id occurs at least ``win_size * tau_r`` times in the last
``win_size`` generated ids, it is excluded (-inf) and one id is drawn from the softmax of the full
vocabulary (the later reference, which can no longer re-draw the repeated id).

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


def nucleus_mask(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the descending-sorted probabilities [..., K] the nucleus keeps: the mass before an entry
    is < top_p (so the entry that crosses top_p is kept), and always the first."""
    keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    keep[..., 0] = True
    return keep


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


def ras_core(
    logp: torch.Tensor, u: torch.Tensor, window: torch.Tensor, cfg: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RAS draw as pure tensor math (no host sync), shared by every backend.

    logp [B, V] with forbidden ids at -inf; u [B, 2] uniforms (nucleus draw, fallback draw); window [B, W]
    the last generated ids (-1 = empty; order does not matter) -> (ids [B], refused [B] bool).
    """
    probs = logp.softmax(-1)
    top_p, top_i = probs.topk(min(cfg.top_k, probs.shape[-1]), dim=-1)  # sorted descending: top_k cap
    keep = nucleus_mask(top_p, cfg.top_p)
    pick = top_i.gather(1, _inverse_cdf(top_p * keep, u[:, 0]).unsqueeze(1)).squeeze(1)  # [B]
    refuse = (window == pick.unsqueeze(1)).sum(1) >= cfg.win_size * cfg.tau_r
    fallback = logp.scatter(1, pick.unsqueeze(1), -math.inf).softmax(-1)
    return torch.where(refuse, _inverse_cdf(fallback, u[:, 1]), pick), refuse


def sample_step(logp: torch.Tensor, states: Sequence[SamplerState], cfg: SamplingConfig) -> list[int]:
    """One RAS step for a batch: log-probs (or logits) [B, V] on any device -> one id per request."""
    u = torch.stack([torch.rand(2, generator=s.generator) for s in states]).to(logp.device)  # [B, 2]
    logp = _mask_stops(logp.float(), states)
    ids, refused = ras_core(logp, u, _window(states, cfg.win_size, logp.device), cfg)
    out, fell_back = torch.stack([ids, refused.long()]).tolist()  # the step's one host sync
    for state, tok, fell in zip(states, out, fell_back):
        state.history.append(tok)
        state.fallbacks += int(fell)
    return out


class DeviceRAS:
    """RAS for a persistent batch (vLLM's) with every request's state on the device: no host sync per step.

    Row r holds one request: its uniforms for every step (drawn up front from its own seeded generator, the
    same stream ``SamplerState`` draws two at a time, so both give the same ids for the same logits), a ring
    buffer of its last ``win_size`` ids, its step count and minimum length, its stop ids, a greedy flag.
    """

    def __init__(
        self, vocab: int, device: torch.device, cfg: SamplingConfig, rows: int = 256, steps: int = 4096
    ):
        self.cfg, self.vocab, self.steps = cfg, vocab, steps
        self.uniforms = torch.zeros(rows, steps, 2, device=device)
        self.window = torch.full((rows, cfg.win_size), -1, dtype=torch.long, device=device)
        self.count = torch.zeros(rows, dtype=torch.long, device=device)
        self.min_len = torch.zeros(rows, dtype=torch.long, device=device)
        self.stops = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.greedy = torch.zeros(rows, dtype=torch.bool, device=device)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.uniforms, self.window, self.count, self.min_len, self.stops, self.active, self.greedy]

    def add(
        self,
        row: int,
        seed: int,
        min_len: int,
        stop_ids: Sequence[int],
        greedy: bool,
        history: Sequence[int] = (),
    ) -> None:
        """A request enters batch row ``row`` (``history``: ids it already generated, after preemption)."""
        gen = torch.Generator().manual_seed(seed)
        self.uniforms[row] = torch.rand(self.steps, 2, generator=gen)
        recent = list(history)[-self.cfg.win_size :]
        ring = torch.full((self.cfg.win_size,), -1, dtype=torch.long)
        for i, tok in enumerate(recent, start=len(history) - len(recent)):
            ring[i % self.cfg.win_size] = tok
        self.window[row] = ring
        self.count[row], self.min_len[row] = len(history), min_len
        self.stops[row] = _stop_row(frozenset(stop_ids), self.vocab)
        self.active[row], self.greedy[row] = True, greedy

    def remove(self, row: int) -> None:
        self.active[row] = False

    def move(self, src: int, dst: int, swap: bool) -> None:
        for t in self._tensors():
            if swap:
                t[[src, dst]] = t[[dst, src]]
            else:
                t[dst] = t[src]
        if not swap:
            self.active[src] = False

    def step(self, logits: torch.Tensor, rows_in_use: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V] of batch rows 0..B-1 -> logits whose active rows allow exactly the sampled id.

        ``rows_in_use``: a 0-d long tensor on the device; only rows below it take part, the others are
        padding (a replayed graph's batch is a fixed bucket: ``engine.lm.ras_graphs``); at 0 the step
        changes no state. None: every row of ``logits``."""
        b = logits.shape[0]
        act, count = self.active[:b], self.count[:b]
        if rows_in_use is not None:
            act = act & (torch.arange(b, device=logits.device) < rows_in_use)
        early = (count < self.min_len[:b]).unsqueeze(1) & self.stops[:b]
        logp = logits.float().masked_fill(early, -math.inf)
        u = self.uniforms[:b].gather(1, count.clamp(max=self.steps - 1).view(b, 1, 1).expand(b, 1, 2))[:, 0]
        ids, _ = ras_core(logp, u, self.window[:b], self.cfg)
        ids = torch.where(self.greedy[:b], logp.argmax(-1), ids)
        slot = (count % self.cfg.win_size).unsqueeze(1)
        old = self.window[:b].gather(1, slot).squeeze(1)
        self.window[:b].scatter_(1, slot, torch.where(act, ids, old).unsqueeze(1))
        self.count[:b] += act.long()
        forced = torch.full_like(logits, -math.inf).scatter_(1, ids.unsqueeze(1), 0.0)
        return torch.where(act.unsqueeze(1), forced, logits)
