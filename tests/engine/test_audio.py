"""engine/audio.py: decoding checks, resampling, and the feature extractors against references built here.

The feature references are written from the formulas (explicit DFT matrices in float64, a small numpy Kaldi
fbank, a Slaney filterbank built with np.interp), not from the code under test. Tolerances: the engine runs
its STFTs in float32, so log-domain values may differ by ~1e-5; we allow 1e-4 absolute (prompt mel, whisper
log-mel, whose values are O(1..10); measured ~5e-7), 5e-4 for the Kaldi fbank (kaldi-native-fbank works in
float32 with its own FFT; measured max 4e-5) and 1e-6 relative to the peak for the filterbank.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from engine import audio
from engine.audio import AudioLimits
from engine.errors import InvalidInput, TooLarge

RNG = np.random.default_rng(0)


def tone(sr: int, seconds: float, freq: float = 440.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(round(sr * seconds)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def wav_bytes(x: np.ndarray, sr: int, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def av_bytes(container: str, codec: str, sr: int, x: np.ndarray) -> bytes:
    """Encode float32 [C, N] with PyAV (FFmpeg) into an in-memory container."""
    import av

    layout = "stereo" if x.shape[0] == 2 else "mono"
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=sr)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x), format="fltp", layout=layout)
        frame.sample_rate = sr
        for packet in (*stream.encode(frame), *stream.encode(None)):
            out.mux(packet)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ decoding


def test_wav_bytes_and_path_round_trip(tmp_path):
    x = tone(24000, 1.5)
    got = audio.read_audio(wav_bytes(x, 24000))
    assert got.sample_rate == 24000 and got.samples.dtype == np.float32
    np.testing.assert_allclose(got.samples, x, atol=1.0 / 32768)  # PCM_16 quantisation
    path = tmp_path / "p.flac"
    sf.write(path, x, 24000, subtype="PCM_24")
    np.testing.assert_allclose(audio.read_audio(path).samples, x, atol=1e-6)
    assert audio.read_audio(str(path)).duration_s == pytest.approx(1.5)


def test_stereo_is_averaged():
    left, right = tone(16000, 1.0, 300), tone(16000, 1.0, 700, 0.2)
    got = audio.read_audio(wav_bytes(np.stack([left, right], axis=1), 16000, "FLOAT"))
    np.testing.assert_allclose(got.samples, (left + right) / 2, atol=1e-7)


def test_load_audio_resamples_to_target():
    x = tone(48000, 1.0, 1000)
    got = audio.load_audio(wav_bytes(x, 48000, "FLOAT"), 16000)
    assert len(got) == 16000
    np.testing.assert_allclose(got[200:-200], tone(16000, 1.0, 1000)[200:-200], atol=2e-3)


@pytest.mark.parametrize(("container", "codec"), [("ipod", "aac"), ("webm", "libopus")])
def test_pyav_fallback_for_containers_libsndfile_cannot_read(container, codec):
    sr = 48000
    x = np.stack([tone(sr, 1.0, 440), tone(sr, 1.0, 440)])
    data = av_bytes(container, codec, sr, x)
    with pytest.raises(sf.LibsndfileError):
        sf.info(io.BytesIO(data))  # so this test really exercises the FFmpeg path
    got = audio.read_audio(data)
    assert got.sample_rate == sr
    assert got.duration_s == pytest.approx(1.0, abs=0.1)  # codec priming / padding
    rms = float(np.sqrt(np.mean(got.samples[4800:-4800] ** 2)))
    assert rms == pytest.approx(0.3 / np.sqrt(2), rel=0.1)


def test_mp3_is_read():
    data = wav_bytes(tone(24000, 1.0), 24000, "MPEG_LAYER_III", "MP3")
    got = audio.read_audio(data)
    assert got.duration_s == pytest.approx(1.0, abs=0.1) and got.sample_rate == 24000


@pytest.mark.parametrize("data", [b"not audio at all" * 50, b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(40)])
def test_garbage_is_invalid_input(data):
    with pytest.raises(InvalidInput, match="not a readable audio file") as err:
        audio.read_audio(data)
    assert not isinstance(err.value, TooLarge)


def test_empty_inputs():
    with pytest.raises(InvalidInput, match="empty"):
        audio.read_audio(b"")
    with pytest.raises(InvalidInput, match="no samples"):
        audio.read_audio(wav_bytes(np.zeros(0, np.float32), 16000))
    with pytest.raises(InvalidInput, match="not found"):
        audio.read_audio("/nonexistent/prompt.wav")


def test_nan_samples_rejected():
    x = tone(16000, 1.0)
    x[100] = np.nan
    with pytest.raises(InvalidInput, match="NaN"):
        audio.read_audio(wav_bytes(x, 16000, "FLOAT"))
    with pytest.raises(InvalidInput, match="NaN"):
        audio.decode_array(np.where(np.arange(16000) == 5, np.inf, x), 16000)


def test_low_sample_rate_rejected_with_reason():
    with pytest.raises(InvalidInput, match=r"8000 Hz.*16000 Hz"):
        audio.read_audio(wav_bytes(tone(8000, 1.0), 8000))
    with pytest.raises(InvalidInput, match="16000"):
        audio.decode_array(tone(8000, 1.0), 8000)


def test_duration_and_size_limits():
    data = wav_bytes(tone(16000, 3.0), 16000)
    with pytest.raises(TooLarge, match="limit is 2 s"):
        audio.read_audio(data, AudioLimits(max_seconds=2.0))
    with pytest.raises(InvalidInput, match="at least 4 s") as err:
        audio.read_audio(data, AudioLimits(min_seconds=4.0))
    assert not isinstance(err.value, TooLarge)
    with pytest.raises(TooLarge, match="MiB"):
        audio.read_audio(data, AudioLimits(max_bytes=1000))


def test_declared_length_refused_before_reading(monkeypatch):
    def no_read(*args, **kwargs):
        raise AssertionError("samples were read although the header already exceeds the limit")

    monkeypatch.setattr(sf.SoundFile, "read", no_read)
    with pytest.raises(TooLarge):
        audio.read_audio(wav_bytes(tone(16000, 40.0), 16000))


def test_lying_header_does_not_allocate_its_claim():
    """A data chunk that claims ~4 GiB: at most the real (or limited) length is ever allocated."""
    import tracemalloc

    raw = bytearray(wav_bytes(tone(16000, 1.0), 16000))
    at = raw.find(b"data")
    raw[at + 4 : at + 8] = (0xFFFFFFF0).to_bytes(4, "little")
    raw[4:8] = (0xFFFFFFF8).to_bytes(4, "little")
    tracemalloc.start()
    try:
        got = audio.read_audio(bytes(raw))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.duration_s == pytest.approx(1.0)
    assert peak < 20 * 2**20


def test_pyav_stops_decoding_past_the_limit():
    data = av_bytes("ipod", "aac", 16000, tone(16000, 4.0)[None])
    with pytest.raises(TooLarge):
        audio.read_audio(data, AudioLimits(max_seconds=2.0))


def test_silence_rejected_helpfully():
    with pytest.raises(InvalidInput, match="silent"):
        audio.read_audio(wav_bytes(np.zeros(16000, np.float32), 16000))
    quiet = tone(16000, 1.0, amp=1e-3)  # -63 dBFS speech is still accepted
    assert audio.decode_array(quiet, 16000).duration_s == pytest.approx(1.0)


def test_decode_array_gradio_int16_and_layouts():
    x = tone(22050, 1.0)
    pcm = np.round(x * 32767).astype(np.int16)
    got = audio.decode_array(pcm, 22050)
    np.testing.assert_allclose(got.samples, pcm / 32768.0, atol=1e-7)
    stereo = np.stack([pcm, np.zeros_like(pcm)], axis=1)  # Gradio: (samples, channels)
    np.testing.assert_allclose(audio.decode_array(stereo, 22050).samples, pcm / 65536.0, atol=1e-7)
    np.testing.assert_allclose(audio.decode_array(stereo.T, 22050).samples, pcm / 65536.0, atol=1e-7)
    u8 = np.full(16000, 128, np.uint8)
    u8[::2] = 192
    np.testing.assert_allclose(audio.decode_array(u8, 16000).samples[:2], [0.5, 0.0])
    with pytest.raises(TooLarge):
        audio.decode_array(np.zeros(16000 * 31, np.int16), 16000)
    with pytest.raises(InvalidInput, match="1-D or 2-D"):
        audio.decode_array(np.zeros((2, 2, 2)), 16000)


def test_resample_rates_and_identity():
    x = tone(24000, 0.5)
    assert audio.resample(x, 24000, 24000) is not None
    np.testing.assert_array_equal(audio.resample(x, 24000, 24000), x)
    y = audio.resample(x, 24000, 16000)
    assert y.dtype == np.float32 and len(y) == 8000
    np.testing.assert_allclose(y[100:-100], tone(16000, 0.5)[100:-100], atol=2e-3)


def test_to_wav_bytes_round_trips():
    x = tone(24000, 0.5)
    back, sr = sf.read(io.BytesIO(audio.to_wav_bytes(x, 24000)), dtype="float32")
    assert sr == 24000
    np.testing.assert_allclose(back, x, atol=1.0 / 32768)


# ------------------------------------------------------------------------------------------------ features


def slaney_hz(mel: np.ndarray) -> np.ndarray:
    """Slaney mel -> Hz written independently: 200/3 Hz per mel up to 15 mel (1 kHz), then 6.4x per 27 mel."""
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel < 15, mel * 200 / 3, 1000.0 * 6.4 ** ((mel - 15) / 27))


def reference_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    def to_mel(hz: float) -> float:
        return hz * 3 / 200 if hz < 1000 else 15 + 27 * np.log(hz / 1000) / np.log(6.4)

    edges = slaney_hz(np.linspace(to_mel(fmin), to_mel(fmax), n_mels + 2))
    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    rows = [
        np.interp(freqs, edges[i : i + 3], [0.0, 1.0, 0.0], left=0.0, right=0.0)
        * 2
        / (edges[i + 2] - edges[i])
        for i in range(n_mels)
    ]
    return np.array(rows)


@pytest.mark.parametrize(
    ("sr", "n_fft", "n_mels", "fmax"),
    [(24000, 1920, 80, 8000.0), (24000, 1920, 80, None), (16000, 400, 128, None)],
)
def test_mel_filterbank_matches_slaney_definition(sr, n_fft, n_mels, fmax):
    got = audio.mel_filterbank(sr, n_fft, n_mels, 0.0, fmax)
    ref = reference_filterbank(sr, n_fft, n_mels, 0.0, fmax or sr / 2)
    assert got.shape == (n_mels, n_fft // 2 + 1) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-6 * ref.max())
    top = fmax or sr / 2
    assert not got[:, np.arange(n_fft // 2 + 1) * sr / n_fft > top].any()  # nothing above fmax
    wide = got[-10:]  # filters much wider than a bin: discrete area ~ 1 (Slaney normalisation)
    np.testing.assert_allclose(wide.sum(axis=1) * sr / n_fft, 1.0, rtol=0.02)


def test_mel_scale_breakpoint_and_inverse():
    assert float(audio.hz_to_mel(1000.0)) == pytest.approx(15.0)
    assert float(audio.hz_to_mel(500.0)) == pytest.approx(7.5)
    assert float(audio.hz_to_mel(6400.0)) == pytest.approx(42.0)
    hz = np.array([0.0, 123.0, 999.0, 1000.0, 4321.0, 12000.0])
    np.testing.assert_allclose(audio.mel_to_hz(audio.hz_to_mel(hz)), hz, atol=1e-9)


def dft_magnitude_sq(frames: np.ndarray) -> np.ndarray:
    """|DFT|^2 of windowed frames [T, n] by an explicit cosine/sine matrix (no FFT): [n//2+1, T]."""
    n = frames.shape[1]
    k = np.arange(n // 2 + 1)[:, None] * np.arange(n)[None, :]
    re = np.cos(2 * np.pi * k / n) @ frames.T
    im = -np.sin(2 * np.pi * k / n) @ frames.T
    return re**2 + im**2


def frame_signal(x: np.ndarray, length: int, hop: int) -> np.ndarray:
    count = 1 + (len(x) - length) // hop
    return np.stack([x[i * hop : i * hop + length] for i in range(count)])


def periodic_hann(n: int) -> np.ndarray:
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)


@pytest.mark.parametrize("fmax", [8000.0, None])
def test_prompt_mel_matches_dft_reference(fmax):
    x = (RNG.standard_normal(24000 * 3 // 10) * 0.1).astype(np.float32)
    padded = np.pad(x.astype(np.float64), 720, mode="reflect")
    power = dft_magnitude_sq(frame_signal(padded, 1920, 480) * periodic_hann(1920))
    basis = reference_filterbank(24000, 1920, 80, 0.0, fmax or 12000.0)
    ref = np.log(np.maximum(basis @ np.sqrt(power + 1e-9), 1e-5)).T
    got = audio.prompt_mel(x, fmax)
    assert got.shape == (len(x) // 480, 80) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("n", [24000, 24479, 24480, 24959])
def test_prompt_mel_frame_count(n):
    assert audio.prompt_mel(tone(24000, n / 24000), None).shape[0] == n // 480


def test_prompt_mel_fmax_changes_only_the_basis():
    x = tone(24000, 0.5, 3000)
    v2, v3 = audio.prompt_mel(x, 8000.0), audio.prompt_mel(x, None)
    assert v2.shape == v3.shape and not np.allclose(v2, v3)


def test_whisper_log_mel_matches_dft_reference():
    x = (RNG.standard_normal(16000 // 4) * 0.1).astype(np.float32)
    x[:800] *= 1e-4  # a quiet start so the (max - 8) floor is active somewhere
    padded = np.pad(x.astype(np.float64), 200, mode="reflect")
    power = dft_magnitude_sq(frame_signal(padded, 400, 160) * periodic_hann(400))[:, :-1]
    log_spec = np.log10(np.maximum(reference_filterbank(16000, 400, 128, 0.0, 8000.0) @ power, 1e-10))
    ref = (np.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0
    got = audio.whisper_log_mel(x)
    assert got.shape == (128, len(x) // 160) and got.dtype == np.float32
    assert np.isclose(got.min(), (log_spec.max() - 8 + 4) / 4, atol=1e-4)  # the floor was reached
    np.testing.assert_allclose(got, ref, atol=1e-4)


def kaldi_reference(x: np.ndarray) -> np.ndarray:
    """Kaldi compute-fbank defaults (dither 0) in float64, written from the Kaldi documentation."""
    frames = frame_signal(x.astype(np.float64), 400, 160)
    frames = frames - frames.mean(axis=1, keepdims=True)
    frames = np.concatenate([frames[:, :1] * 0.03, frames[:, 1:] - 0.97 * frames[:, :-1]], axis=1)
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 399)) ** 0.85
    padded = np.zeros((len(frames), 512))
    padded[:, :400] = frames * povey
    power = np.abs(np.fft.rfft(padded, axis=1)) ** 2  # [T, 257]

    def mel(f):
        return 1127.0 * np.log(1.0 + np.asarray(f) / 700.0)

    lo, hi = mel(20.0), mel(8000.0)
    delta = (hi - lo) / 81
    bin_mel = mel(np.arange(256) * 16000 / 512)
    banks = np.zeros((80, 257))
    for b in range(80):
        left, center, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta
        up, down = (bin_mel - left) / (center - left), (right - bin_mel) / (right - center)
        banks[b, :256] = np.maximum(0.0, np.minimum(up, down))
    feats = np.log(np.maximum(power @ banks.T, np.finfo(np.float32).eps))
    return feats - feats.mean(axis=0)


def test_kaldi_fbank_matches_numpy_kaldi():
    x = (RNG.standard_normal(16000) * 0.05 + tone(16000, 1.0, 250, 0.2)).astype(np.float32)
    got = audio.kaldi_fbank(x)
    assert got.shape == (1 + (16000 - 400) // 160, 80) and got.dtype == np.float32
    np.testing.assert_allclose(got.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(got, kaldi_reference(x), atol=5e-4)


def test_feature_extractors_refuse_tiny_input():
    for fn in (audio.whisper_log_mel, audio.kaldi_fbank, audio.prompt_mel):
        with pytest.raises(InvalidInput, match="too short"):
            fn(np.zeros(100, np.float32))
