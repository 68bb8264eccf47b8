"""The request and chunk contracts between the engine and its callers (UI, API, CLI, bench)."""

from __future__ import annotations

import enum
import uuid
from collections.abc import AsyncIterable
from dataclasses import dataclass, field

import numpy as np

from engine.serving.metrics import ChunkTrace, RequestMetrics


class Mode(enum.StrEnum):
    """Synthesis modes; ``instruct`` runs the reference's instruct2 path on v2/v3."""

    ZERO_SHOT = "zero_shot"
    CROSS_LINGUAL = "cross_lingual"
    INSTRUCT = "instruct"
    VC = "vc"


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis job. Either ``prompt_wav`` (a path or decoded audio) or ``voice_id`` names the voice.

    ``prompt_audio`` is (samples float32 mono in [-1, 1], sample rate Hz) when the caller already decoded it.
    ``source_wav`` is the speech to convert in ``vc`` mode. ``speed`` is a playback-rate factor (1.0 = as
    generated). ``voice_owner`` is the browser id or API key whose private voices ``voice_id`` may name;
    ``voice_id`` may also be an example voice or a stock OpenAI name. ``seed`` None draws a fresh seed
    which the engine reports back in the metrics. ``text_stream``, when given, replaces ``text``: the text
    arrives in pieces as it is written (bistream decoding; the time to first audio counts from the first
    piece).
    """

    text: str = ""
    mode: Mode = Mode.ZERO_SHOT
    prompt_wav: str | None = None
    prompt_audio: tuple[np.ndarray, int] | None = field(default=None, compare=False, repr=False)
    voice_id: str | None = None
    voice_owner: str | None = None  # whose saved voices voice_id may name (None: the public ones only)
    prompt_text: str = ""
    instruct_text: str = ""
    source_wav: str | None = None
    source_audio: tuple[np.ndarray, int] | None = field(default=None, compare=False, repr=False)
    language: str = "auto"
    stream: bool = True
    speed: float = 1.0
    seed: int | None = None
    text_frontend: bool = True
    forced_tokens: int | None = (
        None  # bench/tests: exactly this many speech tokens per segment (not in the API)
    )
    request_id: str = field(default_factory=new_request_id)
    text_stream: AsyncIterable[str] | None = field(default=None, compare=False, repr=False)

    @property
    def streams_audio(self) -> bool:
        """Whether the audio goes out chunk by chunk: asked for, at speed 1. Another speed re-times a whole
        mel (``engine.vocoder.streaming.stretches``), so it turns streaming off: audio comes per segment."""
        return self.stream and self.speed == 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        if not 0.5 <= self.speed <= 2.0:
            raise ValueError(f"speed must be within [0.5, 2.0], got {self.speed}")
        if self.forced_tokens is not None and not 1 <= self.forced_tokens <= 3000:
            raise ValueError(f"forced_tokens must be within [1, 3000], got {self.forced_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")


@dataclass(frozen=True)
class AudioChunk:
    """A piece of the output stream: float32 mono PCM at ``sample_rate``; ``is_last`` closes the stream."""

    pcm: np.ndarray
    sample_rate: int
    index: int
    is_last: bool
    metrics: RequestMetrics
    trace: ChunkTrace | None = field(default=None, compare=False, repr=False)  # its way through the engine

    @property
    def seconds(self) -> float:
        return len(self.pcm) / self.sample_rate
