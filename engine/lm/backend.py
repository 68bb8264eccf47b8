"""The contract every speech-LM backend (native, vLLM) fulfils."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.lm.bistream import LMSession
from engine.lm.sampling import SamplerState


@dataclass(frozen=True, eq=False)
class LMRequest:
    """One segment's decode: prefix embeddings [P, H] (float32, any device) and its sampling limits.

    ``priority``: lower goes first where a backend must choose whom to start or keep (vLLM's priority
    scheduler, the native loop's admission): ``URGENT`` for a listener with no audio buffered (a first
    segment, or one whose buffer ran dry), ``BUFFERED`` for a later segment of a request still playing.
    """

    URGENT = 0
    BUFFERED = 1

    request_id: str
    prefix: torch.Tensor
    seed: int
    min_len: int
    max_len: int
    stop_ids: tuple[int, ...]
    priority: int = URGENT

    def sampler(self) -> SamplerState:
        return SamplerState.seeded(self.seed, self.min_len, self.max_len, self.stop_ids)


class LMBackend(Protocol):
    @property
    def name(self) -> str:
        """Which backend serves (native, vllm): for logs and /ready."""
        ...

    def generate(self, req: LMRequest) -> AsyncIterator[int]:
        """Speech-token ids as sampled (stop id excluded); closing the iterator aborts the request."""
        ...

    def session(self, request_id: str, seed: int) -> LMSession:
        """A text-streaming (bistream) request: rounds of input, each decoded until its fill / stop."""
        ...

    @property
    def active(self) -> int: ...

    @property
    def healthy(self) -> bool:
        """False once the backend can no longer decode (its worker or engine process died)."""
        ...

    def close(self) -> None: ...
