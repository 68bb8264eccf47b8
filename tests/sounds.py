"""Synthetic test audio: a voiced, amplitude-modulated harmonic signal that passes the prompt checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf


def speech_like(seconds: float = 3.0, sr: int = 24000, f0: float = 140.0, seed: int = 0) -> np.ndarray:
    """float32 mono: 5 harmonics of a wobbling f0, syllable-rate envelope, a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    pitch = f0 * (1 + 0.05 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sr
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2
    return (0.2 * voice * envelope + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def write_wav(path: Path, seconds: float = 3.0, sr: int = 24000, seed: int = 0) -> Path:
    sf.write(path, speech_like(seconds, sr, seed=seed), sr, subtype="PCM_16")
    return path
