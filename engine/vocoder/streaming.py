"""The vocoder's per-request streaming state: the v2 and v3 HiFT continuations across a stream's chunks.

v2 re-vocodes the last mel frames and cross-fades the overlap; v3's causal HiFT re-runs on all mel so far and
emits only the samples not yet sent. A whole-file call at another speed vocodes a time-stretched mel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import StreamConfig

Hift2 = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Hift3 = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def hamming(n: int) -> torch.Tensor:
    """numpy's symmetric Hamming window (the reference's speech_window), float32."""
    return torch.from_numpy(np.hamming(n).astype(np.float32))


def stretches(finalize: bool, speed: float, fresh: bool) -> bool:
    """Whether a vocoder call runs on a speed-stretched mel: speed re-times a whole mel, so only a whole-file
    call (``finalize`` with nothing vocoded before: ``fresh``) at a speed other than 1 does."""
    return finalize and fresh and speed != 1.0


class V2VocoderState:
    """HiFT continuation for v2: re-vocode the last 8 mel frames, reuse 3840 source samples, cross-fade.

    Each non-final call withholds its last ``source_cache_samples`` samples; the next call's first samples
    re-synthesise that span and are cross-faded with it using the two halves of Hamming(2 * cache).
    ``prepared``, ``faded`` and ``commit`` are ``step``'s parts for a caller that runs HiFT on several
    requests' rows at once: nothing changes until ``commit``.
    """

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg
        self.window = hamming(2 * cfg.source_cache_samples)
        self.mel: torch.Tensor | None = None
        self.source: torch.Tensor | None = None
        self.tail: torch.Tensor | None = None

    def step(self, mel: torch.Tensor, finalize: bool, hift: Hift2, speed: float = 1.0) -> torch.Tensor:
        """mel [1, 80, T] new frames -> new speech [1, S] ready to play."""
        call = self.prepared(mel, finalize, speed)
        speech, new_source = hift(call.mel, call.source)
        return self.commit(call, self.faded(speech), new_source)

    def prepared(self, mel: torch.Tensor, finalize: bool, speed: float = 1.0) -> V2Call:
        """The HiFT input for the new frames mel [1, 80, T]: the cached frames before them and the cached
        source; the state is unchanged until ``commit``."""
        if self.mel is not None:
            mel = torch.cat([self.mel, mel], dim=2)
        source = self.source if self.source is not None else torch.zeros(1, 1, 0, device=mel.device)
        if stretches(finalize, speed, fresh=self.mel is None):
            mel = stretch_mel(mel, speed)
        return V2Call(mel, source, finalize)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors this state keeps between calls."""
        return [t for t in (self.mel, self.source, self.tail) if t is not None]

    def faded(self, speech: torch.Tensor) -> torch.Tensor:
        """HiFT's speech [1, T*480] with its head cross-faded into the previous call's withheld tail."""
        return speech if self.tail is None else crossfade(speech, self.tail, self.window)

    def commit(self, call: V2Call, faded: torch.Tensor, new_source: torch.Tensor) -> torch.Tensor:
        """``faded`` speech [1, T*480] and HiFT's source [1, 1, T*480] for ``call`` -> the speech to play, a
        prefix of ``faded``; a non-final call keeps its last frames, source and speech for the next one."""
        if call.finalize:
            return faded
        n = self.cfg.source_cache_samples
        self.mel, self.source, self.tail = (
            call.mel[:, :, -self.cfg.mel_cache_frames :],
            new_source[:, :, -n:],
            faded[:, -n:],
        )
        return faded[:, :-n]


@dataclass(frozen=True)
class V2Call:
    """One v2 HiFT call's input: mel [1, 80, T] (cached frames + new ones), cached source [1, 1, S]."""

    mel: torch.Tensor
    source: torch.Tensor
    finalize: bool


class V3VocoderState:
    """Causal HiFT continuation for v3: re-vocode all mel so far and emit only the samples not yet sent.

    Fixed noise buffers make the re-run reproduce the emitted prefix exactly (spec 6.4).
    """

    def __init__(self) -> None:
        self.mel: torch.Tensor | None = None
        self.emitted = 0  # samples already returned

    def step(self, mel: torch.Tensor, finalize: bool, hift: Hift3, speed: float = 1.0) -> torch.Tensor:
        full = self.extended(mel)
        vocode = stretch_mel(full, speed) if self.stretches(finalize, speed) else full
        speech, _ = hift(vocode, finalize)
        return self.commit(full, speech)

    def stretches(self, finalize: bool, speed: float) -> bool:
        """Whether ``step`` vocodes a speed-stretched mel: a whole-file call (nothing sent yet) at another
        speed."""
        return stretches(finalize, speed, fresh=self.emitted == 0)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors this state keeps between calls."""
        return [] if self.mel is None else [self.mel]

    @property
    def frames(self) -> int:
        """Mel frames vocoded so far."""
        return 0 if self.mel is None else self.mel.shape[2]

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
