"""What every API route needs: the engine, the limits, the key, the metrics (no module-level state)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from api.telemetry import Telemetry
from engine.config import Limits
from engine.request import AudioChunk, SynthesisRequest
from engine.serving.metrics import ServerStats


class EngineLike(Protocol):
    """The public surface of ``engine.serving.engine.TTSEngine`` the API uses (``tests/fakes.py`` has it too).

    Read-only properties and positional-only parameters, so plain attributes, properties and any
    parameter names all satisfy it; the voice methods may also be coroutines (``api.voices.call``).
    """

    @property
    def sample_rate(self) -> int: ...

    @property
    def family(self) -> str: ...

    @property
    def model_name(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    def stream(self, req: SynthesisRequest, /) -> AsyncIterator[AudioChunk]: ...

    def abort(self, request_id: str, /) -> bool: ...

    def stats(self) -> ServerStats: ...

    def add_voice(
        self, name: str, prompt_wav: str, prompt_text: str, owner: str | None, consent: str, /
    ) -> Any: ...

    def list_voices(self, owner: str | None, /) -> Any: ...  # a Sequence of voices, or a coroutine of one

    def delete_voice(self, voice_id: str, owner: str | None, /) -> Any: ...

    @property
    def asr_model(self) -> str | None: ...

    async def transcribe(self, audio: tuple[np.ndarray, int], language: str | None, /) -> Any: ...


@dataclass(frozen=True)
class ApiContext:
    engine: EngineLike
    limits: Limits
    api_keys: tuple[str, ...]  # empty: no key needed (every client is one anonymous voice owner)
    telemetry: Telemetry
