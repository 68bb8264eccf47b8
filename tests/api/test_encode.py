"""Encoders: every format decodes back (wav/flac/pcm checked with soundfile or numpy, mp3/opus/aac and the
streamed flac with PyAV), lengths are right, streaming encoders emit bytes before the end."""

from __future__ import annotations

import io
import struct
import sys

import av
import numpy as np
import pytest
import soundfile as sf

from api import encode
from api.app import build_api
from api.encode import (
    FORMATS,
    WAV_UNKNOWN_SIZE,
    encode_audio,
    stream_encoder,
    supported_formats,
    to_int16,
    wav_header,
)
from tests.api.support import wait_until
from tests.fakes import FakeEngine

RATES = (24000, 22050)  # CosyVoice2/3 and CosyVoice1 output rates
LOSSY_PAD_S = (
    0.12  # mp3/aac decoders add encoder delay + last-frame padding (LAME ~0.05 s, AAC 1024+ samples)
)


def tone(sr: int, seconds: float = 1.0, hz: float = 220.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * hz * np.arange(int(sr * seconds)) / sr)).astype(np.float32)


def decode_av(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        x = np.concatenate(frames)
        scale = 32768.0 if x.dtype == np.int16 else 1.0  # the flac decoder gives s16, lossy ones float
        return x.astype(np.float32) / scale, stream.rate


def decode(fmt: str, data: bytes, sr: int, whole: bool) -> tuple[np.ndarray, int]:
    """wav/flac (whole) via soundfile, pcm via numpy, everything else via PyAV."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, sr
    if fmt == "wav" or (fmt == "flac" and whole):
        x, rate = sf.read(io.BytesIO(data), dtype="float32")
        return x, rate
    return decode_av(data)


def dominant_hz(x: np.ndarray, sr: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / sr)[int(np.argmax(spectrum))])


def streamed(fmt: str, x: np.ndarray, sr: int, piece: int = 4800) -> list[bytes]:
    encoder = stream_encoder(fmt, sr)
    return [encoder.feed(x[i : i + piece]) for i in range(0, len(x), piece)] + [encoder.finish()]


def test_all_formats_supported_here() -> None:
    assert set(supported_formats()) == set(FORMATS)


@pytest.mark.parametrize("sr", RATES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "stream"])
def test_decodes_back(fmt: str, sr: int, whole: bool) -> None:
    x = tone(sr)
    data = encode_audio(x, sr, fmt) if whole else b"".join(streamed(fmt, x, sr))
    y, rate = decode(fmt, data, sr, whole)
    seconds = len(y) / rate
    if fmt in ("wav", "pcm", "flac"):
        assert len(y) == len(x) and rate == sr
        assert np.max(np.abs(y - x)) < 2 / 32767  # 16-bit quantization only
    else:
        assert 1.0 <= seconds <= 1.0 + LOSSY_PAD_S, seconds
        assert abs(dominant_hz(y, rate) - 220.0) < 3.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_encoder_emits_before_finish(fmt: str) -> None:
    parts = streamed(fmt, tone(24000), 24000)
    assert parts[0], f"{fmt}: nothing after the first 0.2 s piece"
    assert sum(len(p) for p in parts[:-1]) > len(parts[-1]), f"{fmt}: most bytes should leave before finish"


def test_streamed_and_whole_wav_headers() -> None:
    whole = encode_audio(tone(24000), 24000, "wav")
    assert struct.unpack("<I", whole[4:8])[0] == len(whole) - 8
    assert struct.unpack("<I", whole[40:44])[0] == 2 * 24000
    stream = b"".join(streamed("wav", tone(24000), 24000))
    assert struct.unpack("<I", stream[40:44])[0] == WAV_UNKNOWN_SIZE
    assert stream[44:] == whole[44:]  # same samples; only the sizes differ
    assert sf.info(io.BytesIO(stream)).frames == 24000  # libsndfile reads a size-less wav to its end


def test_int16_clips_instead_of_wrapping() -> None:
    x = np.array([1.5, -1.5, 0.5, 0.0], dtype=np.float32)
    assert to_int16(x).tolist() == [32767, -32767, 16384, 0]


def test_empty_stream_is_still_a_valid_wav() -> None:
    encoder = stream_encoder("wav", 24000)
    data = encoder.finish()
    assert data == wav_header(24000, None)
    assert sf.info(io.BytesIO(data)).frames == 0


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown audio format"):
        stream_encoder("ogg-vorbis", 24000)


def test_the_formats_are_probed_ahead_on_a_thread() -> None:
    """The first speech request finds the formats probed (PyAV imported and its encoders asked) already."""
    supported_formats.cache_clear()
    encode.probe_formats_ahead().join(30)
    assert supported_formats.cache_info().currsize == 1
    assert {"mp3", "opus"} <= set(supported_formats()) and supported_formats.cache_info().hits == 1


def test_a_probe_whose_import_fails_leaves_the_formats_to_the_first_request(monkeypatch) -> None:
    """A failed import ahead (another thread's import of a shared module, say) caches nothing: the first
    request's own call probes, rather than serving a list without PyAV's formats from then on."""
    supported_formats.cache_clear()
    monkeypatch.setitem(sys.modules, "av", None)  # ``import av`` raises ImportError
    encode.probe_formats_ahead().join(30)
    assert supported_formats.cache_info().currsize == 0
    monkeypatch.setitem(sys.modules, "av", av)  # importable again
    assert "mp3" in supported_formats()


def test_the_speech_api_probes_the_formats_as_it_is_built() -> None:
    supported_formats.cache_clear()
    build_api(FakeEngine())
    assert wait_until(lambda: supported_formats.cache_info().currsize == 1)
