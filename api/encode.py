"""Float32 PCM -> response bytes: whole files and incremental (streaming) encoders.

wav and pcm are written here (16-bit little-endian, like OpenAI's); flac via soundfile for whole files;
mp3 (LAME), opus (Ogg) and aac (ADTS) through PyAV, which also streams flac. A streaming encoder's
``feed`` returns the bytes that are final so far, so they can be sent at once; the concatenation of every
``feed`` and ``finish`` is a playable file.
"""

from __future__ import annotations

import functools
import io
import logging
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MEDIA_TYPES = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "opus": "audio/ogg",  # Ogg-encapsulated Opus, as OpenAI sends it
    "aac": "audio/aac",  # ADTS frames: playable while streaming, no seek-back index
    "pcm": "audio/pcm",  # raw s16le mono at the model rate (X-Sample-Rate header)
}
FORMATS = tuple(MEDIA_TYPES)
WAV_UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF/data sizes of a streamed wav: readers then read to the end


@dataclass(frozen=True)
class AvSpec:
    """How PyAV writes one format: the muxer, encoders in order of preference, muxer options."""

    container: str
    codecs: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)


AV_SPECS = {
    "mp3": AvSpec("mp3", ("libmp3lame", "mp3")),
    # Ogg pages default to ~1 s: 20 ms pages let each chunk's bytes leave as soon as it is encoded.
    "opus": AvSpec("ogg", ("libopus", "opus"), {"page_duration": "20000"}),
    "aac": AvSpec("adts", ("aac",)),
    "flac": AvSpec("flac", ("flac",)),
}


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 (clipped: a model overshoot must not wrap around)."""
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2")


def wav_header(sample_rate: int, n_samples: int | None) -> bytes:
    """44-byte header of mono 16-bit PCM; ``None`` samples = streaming (sizes unknown)."""
    data_bytes = WAV_UNKNOWN_SIZE if n_samples is None else 2 * n_samples
    riff_bytes = WAV_UNKNOWN_SIZE if n_samples is None else 36 + data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", riff_bytes)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + (struct.pack("<I", data_bytes))
    )


def _av_codec(fmt: str) -> str | None:
    """The first encoder of ``fmt`` this PyAV build has, else None."""
    try:
        import av
    except ImportError:
        return None
    for name in AV_SPECS[fmt].codecs:
        try:
            av.codec.Codec(name, "w")
        except Exception:  # PyAV raises UnknownCodecError (not exported the same way in every version)
            continue
        return name
    return None


def probe_formats_ahead() -> threading.Thread:
    """``supported_formats`` computed on a thread of its own, now: its PyAV import (40-120 ms) was the first
    speech request's, outside every part of its TTFA the server measures. An import that fails here (PyAV
    absent, or another thread importing a module it shares) probes nothing, so the first request's call
    finds out for itself rather than caching a list without PyAV's formats."""

    def probe() -> None:
        try:
            import av  # noqa: F401
        except ImportError as err:
            logging.getLogger(__name__).debug("no audio formats probed ahead: %s", err)
            return
        supported_formats()

    thread = threading.Thread(target=probe, name="probe-formats", daemon=True)
    thread.start()
    return thread


@functools.cache
def supported_formats() -> tuple[str, ...]:
    """Formats this installation can encode (wav, pcm and flac always; the rest need PyAV's encoders)."""
    return tuple(f for f in FORMATS if f in ("wav", "pcm", "flac") or _av_codec(f) is not None)


class StreamEncoder:
    """Incremental encoder; the base class writes raw s16le PCM."""

    def __init__(self, sample_rate: int):
        self.sample_rate = sample_rate

    def feed(self, pcm: np.ndarray) -> bytes:
        return to_int16(pcm).tobytes()

    def finish(self) -> bytes:
        return b""


class WavStream(StreamEncoder):
    """A header with unknown sizes first, then raw samples."""

    def __init__(self, sample_rate: int):
        super().__init__(sample_rate)
        self.started = False

    def feed(self, pcm: np.ndarray) -> bytes:
        head = b"" if self.started else wav_header(self.sample_rate, None)
        self.started = True
        return head + super().feed(pcm)

    def finish(self) -> bytes:
        return b"" if self.started else wav_header(self.sample_rate, None)


class _Sink:
    """A write-only file: without ``seek`` FFmpeg treats the output as a pipe and never rewrites the
    header of bytes already sent (flac's STREAMINFO then says "length unknown", which is valid)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class AvStream(StreamEncoder):
    """mp3 / opus / aac / flac through PyAV; feeds of any size (PyAV re-frames and resamples to what the
    encoder needs: aac 1024-sample frames, opus 20 ms frames at 48/24/16/12/8 kHz)."""

    def __init__(self, fmt: str, sample_rate: int):
        import av

        super().__init__(sample_rate)
        spec, codec = AV_SPECS[fmt], _av_codec(fmt)
        if codec is None:
            raise ValueError(f"no {fmt} encoder in this PyAV build")
        self.sink = _Sink()
        self.container: Any = av.open(
            self.sink, mode="w", format=spec.container, container_options=spec.options
        )
        rate = self._codec_rate(codec, sample_rate)
        self.stream: Any = self.container.add_stream(codec, rate=rate, layout="mono")
        self.samples = 0

    @staticmethod
    def _codec_rate(codec: str, sample_rate: int) -> int:
        import av

        rates = av.codec.Codec(codec, "w").audio_rates
        if not rates or sample_rate in rates:
            return sample_rate
        higher = [r for r in rates if r >= sample_rate]
        return min(higher) if higher else max(rates)

    def feed(self, pcm: np.ndarray) -> bytes:
        import av

        if len(pcm) == 0:
            return b""
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm, dtype=np.float32)[None, :], format="flt", layout="mono"
        )
        frame.sample_rate, frame.pts = self.sample_rate, self.samples
        self.samples += len(pcm)
        self._mux(self.stream.encode(frame))
        return self.sink.drain()

    def finish(self) -> bytes:
        self._mux(self.stream.encode(None))  # flush the encoder's delay line
        self.container.close()
        return self.sink.drain()

    def _mux(self, packets: list[Any]) -> None:
        for packet in packets:
            self.container.mux(packet)


def stream_encoder(fmt: str, sample_rate: int) -> StreamEncoder:
    if fmt == "pcm":
        return StreamEncoder(sample_rate)
    if fmt == "wav":
        return WavStream(sample_rate)
    if fmt in AV_SPECS:
        return AvStream(fmt, sample_rate)
    raise ValueError(f"unknown audio format {fmt!r}; known: {', '.join(FORMATS)}")


def encode_audio(pcm: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A whole file; wav and flac carry exact lengths (soundfile writes flac's STREAMINFO after the data)."""
    if fmt == "pcm":
        return to_int16(pcm).tobytes()
    if fmt == "wav":
        return wav_header(sample_rate, len(pcm)) + to_int16(pcm).tobytes()
    if fmt == "flac":
        import soundfile as sf

        buf = io.BytesIO()
        sf.write(buf, to_int16(pcm), sample_rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()
    encoder = stream_encoder(fmt, sample_rate)
    return encoder.feed(pcm) + encoder.finish()
