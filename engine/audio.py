"""Audio in: safe decoding of uploads, resampling, and the three feature extractors of the CosyVoice frontend.

Decoding never trusts a header: sizes are checked before any sample is read, and at most
``max_seconds`` worth of frames is ever allocated. Features follow the reference exactly (spec §3.2-3.4):
``prompt_mel`` (flow conditioning, 24 kHz), ``whisper_log_mel`` (speech tokenizer input, 16 kHz) and
``kaldi_fbank`` (CAM++ input, 16 kHz). No torchaudio, no librosa.
"""

from __future__ import annotations

import functools
import io
import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.errors import InvalidInput, TooLarge

if TYPE_CHECKING:
    from engine.config import Limits

log = logging.getLogger(__name__)

AudioSource = str | os.PathLike[str] | bytes | bytearray | memoryview

MIN_SAMPLE_RATE = 16000  # the reference asserts the file rate is >= 16 kHz (cosyvoice/utils/file_utils.py)
PROMPT_SAMPLE_RATE = 24000  # prompt mel rate of v2/v3 (hard-coded in the reference frontend)
TOKENIZER_SAMPLE_RATE = 16000  # speech tokenizer and CAM++ rate

# Prompt mel (matcha mel_spectrogram with the v2/v3 yaml feat_extractor values).
PROMPT_N_FFT = 1920
PROMPT_HOP = 480
PROMPT_N_MELS = 80

# Whisper log-mel (whisper/audio.py, n_mels=128).
WHISPER_N_FFT = 400
WHISPER_HOP = 160
WHISPER_N_MELS = 128


@dataclass(frozen=True)
class AudioLimits:
    """What an upload may be. ``min_rms`` ~ -80 dBFS catches digital silence, not quiet speech."""

    max_seconds: float = 30.0
    min_seconds: float = 0.0
    max_bytes: int = 20 * 1024 * 1024
    min_rms: float = 1e-4
    min_rate: int = MIN_SAMPLE_RATE  # Hz; a prompt needs 16 kHz, transcription resamples from less
    rate_reason: str = "CosyVoice needs at least {min_rate} Hz (the reference frontend asserts this)"

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_seconds < self.max_seconds:
            raise ValueError(
                f"need 0 <= min_seconds < max_seconds, got {self.min_seconds}, {self.max_seconds}"
            )
        if self.max_bytes < 1 or self.min_rms < 0:
            raise ValueError("max_bytes must be positive and min_rms non-negative")

    @classmethod
    def for_prompt(cls, limits: Limits) -> AudioLimits:
        """The prompt-audio limits of an engine configuration."""
        return cls(limits.max_prompt_s, limits.min_prompt_s, limits.max_upload_bytes)


@dataclass(frozen=True, eq=False)
class Audio:
    """Decoded mono audio: float32 samples [N] (nominally in [-1, 1]) at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate

    def at(self, sample_rate: int) -> np.ndarray:
        """The samples at ``sample_rate`` (resampled from this clip's own rate, never chained)."""
        return resample(self.samples, self.sample_rate, sample_rate)


# Anything a caller may hand over as audio: a path or encoded bytes; decoded ``Audio``; (samples, rate) as in
# SynthesisRequest or Gradio's (rate, samples); or a bare array at the caller's default rate.
AudioInput = Audio | str | os.PathLike[str] | bytes | tuple[Any, Any] | np.ndarray


# ---------------------------------------------------------------------------------------------- decoding


def as_audio(source: AudioInput, limits: AudioLimits = AudioLimits(), default_rate: int = 24000) -> Audio:
    """Any ``AudioInput`` -> validated ``Audio`` (a bare array is taken to be at ``default_rate``)."""
    if isinstance(source, Audio):
        return source
    if isinstance(source, tuple):
        first, second = source
        if isinstance(first, int | np.integer):  # Gradio's (rate, samples)
            first, second = second, first
        return decode_array(np.asarray(first), int(second), limits)
    if isinstance(source, np.ndarray):
        return decode_array(source, default_rate, limits)
    return read_audio(source, limits)


def load_audio(source: AudioSource, target_sr: int, limits: AudioLimits = AudioLimits()) -> np.ndarray:
    """Decode a file path or encoded bytes to float32 mono at ``target_sr`` (checked against ``limits``)."""
    return read_audio(source, limits).at(target_sr)


def read_audio(source: AudioSource, limits: AudioLimits = AudioLimits()) -> Audio:
    """Decode a path or encoded bytes to mono at the file's own rate: soundfile first, then PyAV.

    soundfile handles wav/flac/ogg/mp3; PyAV (FFmpeg) the rest (m4a/aac/opus/webm ...).
    """
    data = _open_source(source, limits.max_bytes)
    try:
        frames, rate = _read_soundfile(data, limits)
    except _NotSoundfile:
        frames, rate = _read_pyav(data, limits)
    return _finish(frames, rate, limits)


def decode_array(samples: np.ndarray, sample_rate: int, limits: AudioLimits = AudioLimits()) -> Audio:
    """Audio already in memory (Gradio gives int16 ``(samples,)`` or ``(samples, channels)``) -> ``Audio``.

    Integer PCM is scaled to [-1, 1) by its type's full scale; 2-D input is channels-last unless the first
    axis is clearly the channel axis (<= 8 rows and more columns than rows).
    """
    x = np.asarray(samples)
    if x.ndim not in (1, 2):
        raise InvalidInput(f"audio array must be 1-D or 2-D, got shape {x.shape}")
    if x.ndim == 2 and x.shape[0] <= 8 and x.shape[1] > x.shape[0]:
        x = x.T
    rate = int(sample_rate)
    _check_sample_rate(rate, limits)
    if len(x) > _max_frames(limits, rate):  # refuse before converting (a copy) a huge array
        raise _too_long(len(x) / rate, limits)
    return _finish(_to_float(x).reshape(len(x), -1), rate, limits)


def resample(samples: np.ndarray, from_sr: int, to_sr: int) -> np.ndarray:
    """soxr high-quality resampling of float32 mono samples (the reference uses torchaudio's sinc filter)."""
    if from_sr == to_sr:
        return np.ascontiguousarray(samples, dtype=np.float32)
    import soxr

    return soxr.resample(np.asarray(samples, dtype=np.float32), from_sr, to_sr, quality="HQ").astype(
        np.float32, copy=False
    )


def to_wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV of float samples (clipped to [-1, 1])."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.clip(samples, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


class _NotSoundfile(Exception):
    """libsndfile cannot read this container; try FFmpeg."""


def _open_source(source: AudioSource, max_bytes: int) -> str | io.BytesIO:
    """A path (size-checked) or an in-memory file object; refuses too-large input before reading it."""
    if isinstance(source, bytes | bytearray | memoryview):
        size = len(source)
        data: str | io.BytesIO = io.BytesIO(bytes(source))
    else:
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise InvalidInput(f"audio file not found: {path}")
        size = os.path.getsize(path)
        data = path
    if size == 0:
        raise InvalidInput("the audio is empty (0 bytes)")
    if size > max_bytes:
        raise TooLarge(
            f"the audio is {size / 2**20:.1f} MiB; the upload limit is {max_bytes / 2**20:.1f} MiB"
        )
    return data


def _read_soundfile(data: str | io.BytesIO, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """(frames [N, C] float32, rate) via libsndfile, reading at most the allowed number of frames."""
    import soundfile as sf

    try:
        with sf.SoundFile(data) as f:
            _check_sample_rate(f.samplerate, limits)
            max_frames = _max_frames(limits, f.samplerate)
            if f.frames > max_frames:  # the declared length: refuse before allocating anything
                raise _too_long(f.frames / f.samplerate, limits)
            frames = f.read(frames=max_frames + 1, dtype="float32", always_2d=True)
            return frames, int(f.samplerate)
    except sf.LibsndfileError as err:
        if isinstance(data, io.BytesIO):
            data.seek(0)
        raise _NotSoundfile(str(err)) from err


def _read_pyav(data: str | io.BytesIO, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """(frames [N, C] float32, rate) via FFmpeg; decodes frame by frame and stops past the limit."""
    import av

    try:
        with av.open(data, mode="r") as container:
            if not container.streams.audio:
                raise InvalidInput("the file has no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.codec_context.sample_rate or stream.rate or 0)
            _check_sample_rate(rate, limits)
            declared = _declared_seconds(stream, container)
            if declared > limits.max_seconds + 0.5:  # container durations are approximate
                raise _too_long(declared, limits)
            chunks = list(_decode_frames(container, stream, limits, rate))
    except av.error.FFmpegError as err:
        reason = err.strerror or type(err).__name__  # str(err) carries an errno and a '<none>' file name
        raise InvalidInput(f"not a readable audio file (unknown format or corrupt data): {reason}") from err
    if not chunks:
        raise InvalidInput("the audio contains no samples")
    return np.concatenate(chunks, axis=0), rate


def _decode_frames(container, stream, limits: AudioLimits, rate: int) -> Iterator[np.ndarray]:
    """Planar float frames as [n, C] arrays, lazily; raises TooLarge as soon as the total passes the limit."""
    import av

    resampler = av.AudioResampler(format="fltp")  # keep rate and layout: channels are averaged later
    max_frames, total = _max_frames(limits, rate), 0
    for decoded in itertools.chain(container.decode(stream), [None]):  # None flushes the resampler
        for frame in resampler.resample(decoded):
            chunk = frame.to_ndarray().T  # (channels, n) -> (n, channels)
            total += len(chunk)
            if total > max_frames:
                raise _too_long(total / rate, limits)
            yield chunk


def _declared_seconds(stream, container) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration else 0.0  # AV_TIME_BASE units


def _to_float(x: np.ndarray) -> np.ndarray:
    """Integer PCM -> float32 by full scale; floats pass through as float32."""
    if x.dtype == np.uint8:
        return (x.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(x.dtype, np.integer):
        return (x.astype(np.float64) / float(-np.iinfo(x.dtype).min)).astype(np.float32)
    if np.issubdtype(x.dtype, np.floating):
        return x.astype(np.float32, copy=False)
    raise InvalidInput(f"audio samples must be integer or float, got dtype {x.dtype}")


def _finish(frames: np.ndarray, rate: int, limits: AudioLimits) -> Audio:
    """Average channels to mono and apply every content check, in the order a user can act on."""
    _check_sample_rate(rate, limits)
    if frames.shape[0] == 0 or frames.shape[1] == 0:
        raise InvalidInput("the audio contains no samples")
    mono = frames.mean(axis=1, dtype=np.float64).astype(np.float32) if frames.shape[1] > 1 else frames[:, 0]
    if not np.isfinite(mono).all():
        raise InvalidInput("the audio contains NaN or infinite samples")
    seconds = len(mono) / rate
    if seconds > limits.max_seconds:
        raise _too_long(seconds, limits)
    if seconds < limits.min_seconds:
        raise InvalidInput(f"the audio is {seconds:.2f} s long; at least {limits.min_seconds:g} s is needed")
    rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64))))
    if rms < limits.min_rms:
        raise InvalidInput(
            f"the audio is silent (RMS {rms:.1e} < {limits.min_rms:.0e}); record or upload audible speech"
        )
    return Audio(np.ascontiguousarray(mono, dtype=np.float32), rate)


def _check_sample_rate(rate: int, limits: AudioLimits) -> None:
    if rate < limits.min_rate:
        reason = limits.rate_reason.format(min_rate=limits.min_rate)
        khz = f"{limits.min_rate / 1000:g} kHz"
        message = f"the audio's sample rate is {rate} Hz; {reason}. Record or export at {khz} or more"
        raise InvalidInput(message)


def _max_frames(limits: AudioLimits, rate: int) -> int:
    return int(np.ceil(limits.max_seconds * rate))


def _too_long(seconds: float, limits: AudioLimits) -> TooLarge:
    return TooLarge(f"the audio is {seconds:.1f} s long; the limit is {limits.max_seconds:g} s")


# ---------------------------------------------------------------------------------------------- features


def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """Slaney mel scale (librosa htk=False): linear 200/3 Hz per mel below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / (200.0 / 3.0)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, linear)


def mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    """Inverse of ``hz_to_mel``."""
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0)), mel * (200.0 / 3.0))


@functools.lru_cache(maxsize=16)
def mel_filterbank(
    sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters like ``librosa.filters.mel``: [n_mels, n_fft//2+1].

    Cached on all arguments (the reference's cache keyed only on fmax is a known pitfall). Read-only.
    """
    fmax = sr / 2.0 if fmax is None else float(fmax)
    bins_hz = np.arange(n_fft // 2 + 1) * (sr / n_fft)
    edges = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))  # [n_mels + 2] Hz
    rising = (bins_hz[None, :] - edges[:-2, None]) / np.diff(edges)[:-1, None]
    falling = (edges[2:, None] - bins_hz[None, :]) / np.diff(edges)[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]  # slaney norm: each filter has unit area in Hz
    out = weights.astype(np.float32)
    out.setflags(write=False)
    return out


def _as_tensor(wav: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32))


def prompt_mel(wav24k: np.ndarray, fmax: float | None = 8000.0) -> np.ndarray:
    """Flow-conditioning log-mel of 24 kHz audio: float32 [floor(N / 480), 80] (v2 fmax 8000, v3 None).

    Reflect-pad 720 on both sides, periodic Hann(1920) STFT hop 480 without centring, magnitude
    sqrt(re^2 + im^2 + 1e-9), Slaney mel, natural log floored at 1e-5 (matcha mel_spectrogram).
    """
    pad = (PROMPT_N_FFT - PROMPT_HOP) // 2
    if len(wav24k) <= pad:
        raise InvalidInput(f"audio too short for a prompt mel: {len(wav24k)} samples at 24 kHz")
    x = torch.nn.functional.pad(_as_tensor(wav24k)[None, None], (pad, pad), mode="reflect")[0, 0]
    window = torch.hann_window(PROMPT_N_FFT, periodic=True)
    spec = torch.stft(x, PROMPT_N_FFT, PROMPT_HOP, window=window, center=False, return_complex=True)
    magnitude = torch.sqrt(spec.real.square() + spec.imag.square() + 1e-9)  # [F, T]
    basis = torch.from_numpy(
        mel_filterbank(PROMPT_SAMPLE_RATE, PROMPT_N_FFT, PROMPT_N_MELS, 0.0, fmax).copy()
    )
    mel = torch.log(torch.clamp(basis @ magnitude, min=1e-5))
    return mel.T.contiguous().numpy()


def whisper_log_mel(wav16k: np.ndarray) -> np.ndarray:
    """Whisper's 128-bin log-mel of 16 kHz audio: float32 [128, floor(N / 160)] (speech tokenizer input).

    Hann(400) STFT hop 160 centred (reflect), last frame dropped, power, Slaney mel, log10 floored at 1e-10,
    then clipped to (global max - 8) and mapped by (x + 4) / 4.
    """
    if len(wav16k) <= WHISPER_N_FFT // 2:
        raise InvalidInput(f"audio too short for speech tokens: {len(wav16k)} samples at 16 kHz")
    window = torch.hann_window(WHISPER_N_FFT, periodic=True)
    spec = torch.stft(_as_tensor(wav16k), WHISPER_N_FFT, WHISPER_HOP, window=window, return_complex=True)
    power = spec[:, :-1].abs() ** 2  # [201, T]
    basis = torch.from_numpy(mel_filterbank(TOKENIZER_SAMPLE_RATE, WHISPER_N_FFT, WHISPER_N_MELS).copy())
    log_spec = torch.log10(torch.clamp(basis @ power, min=1e-10))
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).numpy()


def kaldi_fbank(wav16k: np.ndarray) -> np.ndarray:
    """CAM++ input: Kaldi 80-bin log fbank of 16 kHz float audio in [-1, 1], mean over time removed: [T, 80].

    Kaldi defaults except dither 0 (25/10 ms frames, povey window, pre-emphasis 0.97, DC removal, 512-point
    power spectrum, 20 Hz .. Nyquist, snip_edges). T = 1 + (N - 400) // 160.
    """
    import kaldi_native_fbank as knf

    if len(wav16k) < 400:
        raise InvalidInput(f"audio too short for a speaker embedding: {len(wav16k)} samples at 16 kHz")
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0  # the library defaults to 3e-5; the reference passes dither=0
    opts.frame_opts.samp_freq = TOKENIZER_SAMPLE_RATE
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(TOKENIZER_SAMPLE_RATE, np.ascontiguousarray(wav16k, dtype=np.float32))
    fbank.input_finished()
    feats = np.stack([np.asarray(fbank.get_frame(i)) for i in range(fbank.num_frames_ready)])
    return (feats - feats.mean(axis=0, keepdims=True)).astype(np.float32)
