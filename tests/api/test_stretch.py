"""api/stretch.py: speed past the model's 0.5-2 as a WSOLA time-stretch: the duration is the input's over
the rate, the pitch stays, and the factor splits into the model's part and the stretch."""

from __future__ import annotations

import numpy as np
import pytest

from api.stretch import split_speed, time_stretch

RATE = 24000


def tone(seconds: float, hz: float = 220.0) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * RATE / len(x))


@pytest.mark.parametrize("rate", [0.5, 0.8, 1.37, 2.0])
def test_the_duration_is_the_inputs_over_the_rate_at_the_same_pitch(rate: float) -> None:
    x = tone(2.0)
    y = time_stretch(x, rate, RATE)
    assert y.dtype == np.float32 and len(y) == round(len(x) / rate)
    assert abs(peak_hz(y) - 220) < 3 and np.abs(y).max() <= 0.51
    middle = y[len(y) // 4 : 3 * len(y) // 4]  # overlap-add keeps the level: no gaps, no doubling
    assert abs(np.sqrt(np.mean(middle**2)) - 0.5 / np.sqrt(2)) < 0.03


def test_audio_too_short_for_frames_is_resampled_and_empty_stays_empty() -> None:
    assert len(time_stretch(tone(0.01), 2.0, RATE)) == 120
    assert len(time_stretch(np.zeros(0, np.float32), 0.5, RATE)) == 0


@pytest.mark.parametrize(
    ("speed", "parts"), [(0.25, (0.5, 0.5)), (0.5, (0.5, 1.0)), (1.3, (1.3, 1.0)), (4.0, (2.0, 2.0))]
)
def test_the_speed_splits_into_the_models_part_and_the_stretch(speed: float, parts: tuple[float, float]):
    assert split_speed(speed) == parts
