"""Per-request streaming state: the token chunk schedule and the two vocoder continuations.

CosyVoice2/3 stream (cli/model.py, spec 6.3-6.4): the first chunk is ``hop + pad`` tokens so that
prompt + chunk ends on the flow's 25-token chunk grid; each chunk needs 3 more tokens of look-ahead; the
flow re-runs on ALL tokens so far and the new mel is sliced from ``offset * 2`` frames; the hop doubles
up to 100. The reference keeps the hop on the shared model object, so request N inherits request N-1's
hop (and races under concurrency); here every request owns its planner, which fixes that defect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import StreamConfig

TOKEN_MEL_RATIO = 2  # mel frames per speech token (25 Hz tokens, 50 Hz mel)
SAMPLES_PER_FRAME = 480  # 24 kHz / 50 Hz
MEL_FRAMES_PER_S = 24000 // SAMPLES_PER_FRAME


@dataclass(frozen=True)
class ChunkJob:
    """Run the flow on tokens [0:end) and keep mel frames from ``mel_start`` on."""

    end: int
    mel_start: int
    finalize: bool

    @property
    def streaming(self) -> bool:
        # The last call uses full-attention masks (reference: finalize=True with stream=False).
        return not self.finalize


class ChunkPlanner:
    """Decides when a chunk is ready; one per request."""

    def __init__(self, prompt_tokens: int, cfg: StreamConfig, stream: bool = True):
        self.cfg, self.stream = cfg, stream
        self.offset = 0  # tokens already turned into audio
        pad = math.ceil(prompt_tokens / cfg.token_hop) * cfg.token_hop - prompt_tokens
        self.hop = cfg.token_hop
        self.this_hop = cfg.token_hop + pad
        self.split_first = bool(cfg.fast_start) and pad >= cfg.min_first_hop  # None (unresolved): off
        if self.split_first:
            self.this_hop = pad  # then hop: the reference's first chunk ends on this same grid line
        self.done = False

    def next_job(self, n_tokens: int, lm_done: bool) -> ChunkJob | None:
        """The next flow job given ``n_tokens`` buffered tokens, or None to wait for more."""
        if self.done:
            return None
        if self.stream and n_tokens - self.offset >= self.this_hop + self.cfg.lookahead:
            job = ChunkJob(
                self.offset + self.this_hop + self.cfg.lookahead, self.offset * TOKEN_MEL_RATIO, False
            )
            self.offset += self.this_hop
            if self.split_first:  # the split-off piece: the rest of the reference's first chunk comes next
                self.split_first = False
            else:
                self.hop = min(self.cfg.max_token_hop, self.hop * self.cfg.hop_growth)
            self.this_hop = self.hop
            return job
        if not lm_done:
            return None
        self.done = True
        return ChunkJob(n_tokens, self.offset * TOKEN_MEL_RATIO, True)


Hift2 = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Hift3 = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def hamming(n: int) -> torch.Tensor:
    """numpy's symmetric Hamming window (the reference's speech_window), float32."""
    return torch.from_numpy(np.hamming(n).astype(np.float32))


class V2VocoderState:
    """HiFT continuation for v2: re-vocode the last 8 mel frames, reuse 3840 source samples, cross-fade.

    Each non-final call withholds its last ``source_cache_samples`` samples; the next call's first samples
    re-synthesise that span and are cross-faded with it using the two halves of Hamming(2 * cache).
    """

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg
        self.window = hamming(2 * cfg.source_cache_samples)
        self.mel: torch.Tensor | None = None
        self.source: torch.Tensor | None = None
        self.tail: torch.Tensor | None = None

    def step(self, mel: torch.Tensor, finalize: bool, hift: Hift2, speed: float = 1.0) -> torch.Tensor:
        """mel [1, 80, T] new frames -> new speech [1, S] ready to play."""
        if self.mel is not None:
            mel = torch.cat([self.mel, mel], dim=2)
        source = self.source if self.source is not None else torch.zeros(1, 1, 0, device=mel.device)
        if finalize and speed != 1.0 and self.mel is None:
            mel = stretch_mel(mel, speed)
        speech, new_source = hift(mel, source)
        if self.tail is not None:
            speech = crossfade(speech, self.tail, self.window)
        if finalize:
            return speech
        n = self.cfg.source_cache_samples
        self.mel, self.source, self.tail = (
            mel[:, :, -self.cfg.mel_cache_frames :],
            new_source[:, :, -n:],
            speech[:, -n:],
        )
        return speech[:, :-n]


class V3VocoderState:
    """Causal HiFT continuation for v3: re-vocode all mel so far and emit only the samples not yet sent.

    Fixed noise buffers make the re-run reproduce the emitted prefix exactly (spec 6.4).
    """

    def __init__(self) -> None:
        self.mel: torch.Tensor | None = None
        self.emitted = 0  # samples already returned

    def step(self, mel: torch.Tensor, finalize: bool, hift: Hift3, speed: float = 1.0) -> torch.Tensor:
        full = self.extended(mel)
        vocode = full
        if finalize and speed != 1.0 and self.emitted == 0:
            vocode = stretch_mel(full, speed)
        speech, _ = hift(vocode, finalize)
        return self.commit(full, speech)

    def extended(self, mel: torch.Tensor) -> torch.Tensor:
        """All mel so far with the new frames [1, 80, T] appended; the state is unchanged until ``commit``."""
        return mel if self.mel is None else torch.cat([self.mel, mel], dim=2)

    def commit(self, full: torch.Tensor, speech: torch.Tensor) -> torch.Tensor:
        """Keep ``full`` as the history; of ``speech`` [1, S] (HiFT over it) return what was not sent yet."""
        self.mel = full
        new = speech[:, self.emitted :]
        self.emitted += new.shape[1]
        return new


def crossfade(fade_in: torch.Tensor, fade_out: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Blend the head of ``fade_in`` with the tail of ``fade_out`` (reference ``fade_in_out``)."""
    n = window.shape[0] // 2
    out = fade_in.clone()
    w = window.to(fade_in.device, fade_in.dtype)
    out[..., :n] = fade_in[..., :n] * w[:n] + fade_out[..., -n:] * w[n:]
    return out


def stretch_mel(mel: torch.Tensor, speed: float) -> torch.Tensor:
    """Speed change by linear interpolation of the whole mel to floor(T / speed) frames (non-streaming)."""
    return torch.nn.functional.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")


SILENT_TOKENS_V3 = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})  # FSQ silence / breath


class SilenceFilter:
    """v3 only (cli/model.py llm_job): keep at most 5 consecutive silent tokens for the flow.

    The LM still conditions on every token; only the list handed to the flow is thinned, which shortens
    long pauses. A non-silent token resets the run.
    """

    def __init__(self, silent: frozenset[int], max_run: int = 5):
        self.silent, self.max_run, self.run = silent, max_run, 0

    def keep(self, token: int) -> bool:
        if token not in self.silent:
            self.run = 0
            return True
        self.run += 1
        return self.run <= self.max_run
