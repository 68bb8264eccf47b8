"""Helpers of the reliability suite: the limits it runs under, the bad audio files, a bounded-compute
wrapper around the real engine, and checks that the engine is idle and still serving."""

from __future__ import annotations

import asyncio
import io
import struct
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from engine.config import EngineConfig, Limits
from engine.request import AudioChunk, Mode, SynthesisRequest
from engine.serving.engine import TTSEngine
from tests.conftest import WAIT_S
from tests.sounds import speech_like

# Small upload cap so an "over the limit" file is cheap to build; the rest are the released defaults.
LIMITS = Limits(max_text_chars=500, max_upload_bytes=4 * 2**20, max_concurrency=4, max_queue=4)
TEXT = "Hello there."
FORCED_TOKENS = 6  # random weights rarely sample a stop id: fix the compute (6 tokens = 0.24 s of audio)
PROMPT_S = 1.5


def load_engine(model_dir: Path, voices_dir: Path, limits: Limits = LIMITS) -> TTSEngine:
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", backend="native", voices_dir=str(voices_dir), limits=limits
    )
    engine = TTSEngine.load(cfg)
    engine.ready = True
    return engine


class Bounded:
    """The real engine, with every request that does not fix its speech-token count fixed to ``tokens``
    (the UI, API and CLI cannot set ``forced_tokens``). Everything else is the engine's own; ``close`` is a
    no-op because the fixture that built the engine closes it."""

    def __init__(self, engine: TTSEngine, tokens: int = FORCED_TOKENS):
        self.engine, self.tokens = engine, tokens

    def stream(self, req: SynthesisRequest) -> Any:
        if req.forced_tokens is None:
            req = replace(req, forced_tokens=self.tokens)
        return self.engine.stream(req)

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def good_request(prompt: Path, **kw: Any) -> SynthesisRequest:
    base: dict[str, Any] = dict(
        text=TEXT, mode=Mode.CROSS_LINGUAL, prompt_wav=str(prompt), seed=1, forced_tokens=FORCED_TOKENS
    )
    return SynthesisRequest(**(base | kw))


async def collect(engine: Any, req: SynthesisRequest) -> list[AudioChunk]:
    return [chunk async for chunk in engine.stream(req)]


def check_pcm(pcm: np.ndarray, min_samples: int = 480) -> None:
    """Valid audio: float32, finite, in range, not empty."""
    assert pcm.dtype == np.float32 and pcm.size >= min_samples, (pcm.dtype, pcm.size)
    assert np.isfinite(pcm).all() and np.abs(pcm).max() <= 1.0


async def assert_serves(engine: TTSEngine, prompt: Path) -> None:
    """A good request right after a bad one completes with valid audio, and nothing is left running."""
    chunks = await collect(engine, good_request(prompt, seed=7))
    assert chunks[-1].is_last
    check_pcm(np.concatenate([c.pcm for c in chunks]))
    assert await wait_idle(engine), idle_state(engine)


def idle_state(engine: TTSEngine) -> dict[str, int]:
    stats = engine.stats()
    return {
        "active_streams": stats.active_streams,
        "queued": stats.queued,
        "lm_active": engine.backend.active,
        "token2wav_pending": engine.token2wav.pending,
    }


async def wait_idle(engine: TTSEngine, timeout_s: float = WAIT_S) -> bool:
    """True once no stream, queue entry, LM sequence or token2wav job is left (polls: they are threads)."""
    deadline = time.monotonic() + timeout_s
    while any(idle_state(engine).values()):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# ----------------------------------------------------------------------------------------------- bad audio


def wav(samples: np.ndarray, sr: int, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def good_wav(seconds: float = PROMPT_S, sr: int = 24000) -> bytes:
    return wav(speech_like(seconds, sr), sr)


def wav_declaring_huge_length() -> bytes:
    """3 s of speech whose RIFF and data chunk sizes claim ~4 GiB: only the real 3 s may be read."""
    data = bytearray(good_wav(3.0))
    data[4:8] = struct.pack("<I", 0xFFFFFFF0)
    at = data.find(b"data")
    data[at + 4 : at + 8] = struct.pack("<I", 0xFFFFFFF0)
    return bytes(data)


def flac_declaring_huge_length() -> bytes:
    """A FLAC whose STREAMINFO claims 2^36 - 1 samples (~33 days): refused before anything is allocated."""
    data = bytearray(wav(speech_like(3.0, 24000), 24000, "PCM_16", "FLAC"))
    assert data[:4] == b"fLaC"
    # STREAMINFO starts at byte 8; bytes 18..26 hold rate(20) channels(3) bits(5) samples(36), big-endian
    packed = int.from_bytes(data[18:26], "big") | ((1 << 36) - 1)
    data[18:26] = packed.to_bytes(8, "big")
    return bytes(data)


def truncated_wav() -> bytes:
    """A header for 3 s followed by 0.5 s of samples (an interrupted upload)."""
    return good_wav(3.0)[: 44 + 24000]


def oversize_wav() -> bytes:
    """Valid audio, but one byte more than the upload limit allows."""
    n = LIMITS.max_upload_bytes // 2  # int16 samples: just over the cap with the header
    return wav(np.zeros(n, np.float32), 24000)


# Every bad (or merely unusual) prompt the issue lists, as encoded bytes.
BAD_AUDIO: dict[str, Callable[[], bytes]] = {
    "silent": lambda: wav(np.zeros(72000, np.float32), 24000),
    "clipped": lambda: wav(np.clip(20 * speech_like(3.0, 24000), -1, 1), 24000),
    "over_full_scale_float": lambda: wav(40 * speech_like(3.0, 24000), 24000, "FLOAT"),
    "too_short": lambda: good_wav(0.3),
    "too_long": lambda: good_wav(31.0, 16000),
    "truncated": truncated_wav,
    "corrupt_header": lambda: b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(40),
    "not_audio_text": lambda: b"this is a text file, not audio\n" * 100,
    "not_audio_png": lambda: b"\x89PNG\r\n\x1a\n" + bytes(2000),
    "empty_file": lambda: b"",
    "8khz": lambda: good_wav(3.0, 8000),
    "192khz": lambda: good_wav(3.0, 192000),
    "8_channels": lambda: wav(np.stack([speech_like(3.0, 24000, seed=i) for i in range(8)], 1), 24000),
    "nan_float": lambda: wav(np.full(72000, np.nan, np.float32), 24000, "FLOAT"),
    "huge_declared_wav": wav_declaring_huge_length,
    "huge_declared_flac": flac_declaring_huge_length,
    "over_upload_limit": oversize_wav,
}
AUDIO_SUFFIX = {"huge_declared_flac": ".flac", "not_audio_text": ".txt", "not_audio_png": ".png"}


def write_bad(directory: Path, case: str) -> Path:
    path = directory / f"{case}{AUDIO_SUFFIX.get(case, '.wav')}"
    if not path.exists():
        path.write_bytes(BAD_AUDIO[case]())
    return path
