"""A voice's prompt tensors kept on the device across its requests (EngineConfig.t2w_kept_prompts).

Each segment's ``Utterance`` needs the prompt's speech tokens, mel and speaker embedding on the device. Made
per request, they are three blocking copies on the event loop, each of which hands the GIL to the serving
threads and waits to get it back: in a burst of arrivals, the longest part of a first token's wait before the
LM. A voice that comes back (an example voice, a saved one, a visitor's next take) reuses the tensors its
first request made; they are never written (the flow stacks them into its own inputs).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.flow.voice_pages import voice_key
from engine.frontend import PromptFeatures


@dataclass(frozen=True, eq=False)
class PromptTensors:
    """One prompt on the device, whole (an Utterance views its trimmed tail)."""

    tokens: Tensor  # [1, L] long, 25 Hz
    feat: Tensor  # [1, T, 80] float32, 50 Hz
    embedding: Tensor  # [1, 192] float32

    @classmethod
    def of(cls, features: PromptFeatures, device: torch.device) -> PromptTensors:
        # blocking copies: the workers' streams read them later with no event to wait on
        return cls(
            torch.tensor(features.speech_tokens, dtype=torch.long, device=device)[None],
            torch.tensor(features.prompt_mel, dtype=torch.float32, device=device)[None],
            torch.tensor(features.speaker_embedding, dtype=torch.float32, device=device)[None],
        )


class KeptPrompts:
    """The last ``size`` prompts' tensors by their content (thread-safe LRU; 0 keeps none: every request
    copies its own). ``size`` may change while serving (the bench's A/B)."""

    def __init__(self, device: torch.device, size: int = 0):
        self.device = device
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, PromptTensors] = OrderedDict()
        self.size = size

    @property
    def size(self) -> int:
        return self._size

    @size.setter
    def size(self, value: int) -> None:
        if not 0 <= value <= 4096:
            raise ValueError(f"kept prompts must be within [0, 4096], got {value}")
        with self._lock:
            self._size = value
            self._evict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def get(self, features: PromptFeatures) -> PromptTensors:
        """``features`` on the device: the kept tensors of the same prompt, else fresh ones (kept if any are).
        The key digests the arrays themselves (~60 KB for a 4-s prompt, tens of microseconds), not a name."""
        if not self._size:  # none kept: no digest to make
            return PromptTensors.of(features, self.device)
        key = voice_key(features.speech_tokens, features.prompt_mel, features.speaker_embedding)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept
        made = PromptTensors.of(features, self.device)  # outside the lock: copies wait on the device
        with self._lock:
            if self._size:
                self._kept[key] = made
                self._evict()
        return made

    def _evict(self) -> None:
        while len(self._kept) > self._size:
            self._kept.popitem(last=False)
