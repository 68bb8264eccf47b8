"""``speed`` beyond what the model does itself: OpenAI's range is 0.25-4, the model re-times its mel
within 0.5-2 (``engine.vocoder.streaming``). The rest of the factor is a time-stretch of the output audio
here, by WSOLA (waveform similarity overlap-add): frames of ``FRAME_S`` taken from the input at ``rate``
times the output's hop, each shifted by up to ``SEARCH_S`` to where it best continues the previous one,
and overlap-added under a Hann window. The pitch stays; the duration becomes ``len / rate``.
"""

from __future__ import annotations

import math

import numpy as np

MODEL_SPEEDS = (0.5, 2.0)  # what the model does natively
FRAME_S = 0.04
SEARCH_S = 0.01


def split_speed(speed: float) -> tuple[float, float]:
    """(the model's speed, the stretch after it): their product is ``speed``."""
    native = min(max(speed, MODEL_SPEEDS[0]), MODEL_SPEEDS[1])
    return native, speed / native


def time_stretch(x: np.ndarray, rate: float, sample_rate: int) -> np.ndarray:
    """``x`` (float32 mono) played ``rate`` times as fast at the same pitch: ``round(len(x) / rate)``
    samples. Audio shorter than two frames is resampled instead (too short for its pitch to matter)."""
    out_len = round(len(x) / rate)
    n = round(FRAME_S * sample_rate)
    if rate == 1.0 or out_len == 0:
        return x[:out_len] if rate == 1.0 else np.zeros(0, np.float32)
    if len(x) < 2 * n:
        positions = np.arange(out_len) * (len(x) / out_len)
        return np.interp(positions, np.arange(len(x)), x).astype(np.float32)
    hop = n // 2
    delta = round(SEARCH_S * sample_rate)
    padded = np.concatenate([x, np.zeros(n + 2 * delta + math.ceil(hop * rate), np.float32)])
    window = np.hanning(n).astype(np.float32)
    out = np.zeros(out_len + n, np.float32)
    weight = np.zeros(out_len + n, np.float32)
    natural = None  # what would follow the frame before, in the input
    for k in range(math.ceil(out_len / hop) + 1):
        center = round(k * hop * rate)
        start = center
        if natural is not None:
            lo, hi = max(0, center - delta), min(center + delta, len(padded) - n)
            scores = np.correlate(padded[lo : hi + n], natural, mode="valid")
            start = lo + int(np.argmax(scores))
        frame = padded[start : start + n]
        at = k * hop
        if at >= out_len:
            break
        out[at : at + n] += frame * window
        weight[at : at + n] += window
        natural = padded[start + hop : start + hop + n]
    return (out[:out_len] / np.maximum(weight[:out_len], 1e-3)).astype(np.float32)
