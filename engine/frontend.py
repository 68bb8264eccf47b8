"""Prompt audio -> ``PromptFeatures``: speech tokens (ONNX tokenizer), CAM++ speaker embedding, prompt mel.

Follows the reference frontend (spec §3.1-3.4, §3.7): the prompt is decoded once and resampled from its own
rate to 16 kHz (tokenizer, CAM++) and to 24 kHz (mel). ONNX inputs are addressed by position, as the
reference does, because the released files' tensor names are not known. Results are cached by content.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine import audio as audio_io
from engine import device as device_mod
from engine.audio import AudioInput, AudioLimits
from engine.errors import InvalidInput, ModelError, TooLarge

if TYPE_CHECKING:
    from engine.hub import ModelDir

log = logging.getLogger(__name__)

SPEECH_VOCAB = 6561  # v2/v3 speech token ids are in [0, 6561)
EMBEDDING_DIM = 192  # CAM++ output
MAX_PROMPT_S = 30.0  # the speech tokenizer's limit (the reference asserts it)
PROMPT_FMAX = {"cosyvoice2": 8000.0, "cosyvoice3": None}  # yaml feat_extractor fmax; None = 12 kHz


@dataclass(frozen=True, eq=False)
class PromptFeatures:
    """What the LM and flow need from a prompt; arrays are read-only (features are shared via the cache).

    ``speech_tokens`` int32 [L] (25 Hz), ``speaker_embedding`` float32 [192], ``prompt_mel`` float32
    [T, 80] (50 Hz; T == 2L when ``trimmed``). ``num_samples`` counts the 24 kHz prompt.
    """

    speech_tokens: np.ndarray
    speaker_embedding: np.ndarray
    prompt_mel: np.ndarray
    num_samples: int
    content_hash: str
    family: str
    trimmed: bool
    sample_rate: int = audio_io.PROMPT_SAMPLE_RATE

    def __post_init__(self) -> None:
        tokens = np.ascontiguousarray(self.speech_tokens, dtype=np.int32).reshape(-1)
        embedding = np.ascontiguousarray(self.speaker_embedding, dtype=np.float32).reshape(-1)
        mel = np.ascontiguousarray(self.prompt_mel, dtype=np.float32)
        if embedding.shape != (EMBEDDING_DIM,) or mel.ndim != 2 or mel.shape[1] != audio_io.PROMPT_N_MELS:
            raise ValueError(f"bad feature shapes: embedding {embedding.shape}, mel {mel.shape}")
        if self.trimmed and len(mel) != 2 * len(tokens):
            raise ValueError(
                f"trimmed features need mel frames == 2 x tokens, got {len(mel)} and {len(tokens)}"
            )
        for name, array in (("speech_tokens", tokens), ("speaker_embedding", embedding), ("prompt_mel", mel)):
            if array is getattr(self, name):
                array = array.copy()  # never freeze the caller's own buffer
            array.setflags(write=False)
            object.__setattr__(self, name, array)

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate

    def trim(self) -> PromptFeatures:
        """The zero-shot 2:1 alignment (spec §3.7): L = min(mel_frames // 2, n_tokens)."""
        if self.trimmed:
            return self
        n = min(len(self.prompt_mel) // 2, len(self.speech_tokens))
        return replace(
            self, speech_tokens=self.speech_tokens[:n], prompt_mel=self.prompt_mel[: 2 * n], trimmed=True
        )


class Frontend:
    """ONNX speech tokenizer + CAM++ sessions for one model family; thread-safe, with a bounded LRU cache."""

    def __init__(
        self,
        campplus: str | os.PathLike[str],
        speech_tokenizer: str | os.PathLike[str],
        family: str,
        device: torch.device | str = "cpu",
        limits: AudioLimits | None = None,
        cache_size: int = 64,
        intra_op_threads: int = 1,
    ):
        if family not in PROMPT_FMAX:
            raise ValueError(f"family must be one of {sorted(PROMPT_FMAX)}, got {family!r}")
        dev = device if isinstance(device, torch.device) else device_mod.resolve(device)
        self.family = family
        self.limits = limits or AudioLimits()
        self.cache_size = cache_size
        # CAM++ is small and runs on the CPU in the reference; the tokenizer (~0.5-0.9 GB) goes to the device.
        self._campplus = _session(campplus, ["CPUExecutionProvider"], intra_op_threads, inputs=1)
        self._tokenizer = _session(
            speech_tokenizer, device_mod.onnx_providers(dev), intra_op_threads, inputs=2
        )
        self._cache: OrderedDict[str, PromptFeatures] = OrderedDict()
        self._running: dict[str, Future[PromptFeatures]] = {}  # content hash -> its computation in flight
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model: ModelDir, device: torch.device | str = "cpu", **kwargs: Any) -> Frontend:
        return cls(model.campplus, model.speech_tokenizer, model.family, device, **kwargs)

    def extract(self, source: AudioInput, trim: bool = True) -> PromptFeatures:
        """Features of a prompt (a bare array is 24 kHz); ``trim=False``: untrimmed, for VC (spec §3.7)."""
        wav16, wav24 = self._decode(source)
        features = self._once(_content_hash(wav16, wav24), wav16, wav24)
        return features.trim() if trim else features

    def speech_tokens(self, source: AudioInput) -> np.ndarray:
        """Speech tokens only (VC source speech): int32 [ceil(frames / 4)]."""
        wav16, _ = self._decode(source, need_24k=False)
        return self._run_tokenizer(audio_io.whisper_log_mel(wav16))

    def cache_info(self) -> tuple[int, int]:
        """(entries, capacity)."""
        with self._lock:
            return len(self._cache), self.cache_size

    # ------------------------------------------------------------------------------------------ internals

    def _decode(self, source: AudioInput, need_24k: bool = True) -> tuple[np.ndarray, np.ndarray]:
        clip = audio_io.as_audio(source, self.limits, audio_io.PROMPT_SAMPLE_RATE)
        if clip.duration_s > MAX_PROMPT_S:
            raise TooLarge(
                f"prompt audio is {clip.duration_s:.1f} s; the speech tokenizer accepts at most 30 s"
            )
        wav24 = clip.at(audio_io.PROMPT_SAMPLE_RATE) if need_24k else np.zeros(0, np.float32)
        return clip.at(audio_io.TOKENIZER_SAMPLE_RATE), wav24

    def _compute(self, wav16: np.ndarray, wav24: np.ndarray, key: str) -> PromptFeatures:
        return PromptFeatures(
            speech_tokens=self._run_tokenizer(audio_io.whisper_log_mel(wav16)),
            speaker_embedding=self._run_campplus(audio_io.kaldi_fbank(wav16)),
            prompt_mel=audio_io.prompt_mel(wav24, PROMPT_FMAX[self.family]),
            num_samples=len(wav24),
            content_hash=key,
            family=self.family,
            trimmed=False,
        )

    def _run_tokenizer(self, feats: np.ndarray) -> np.ndarray:
        """whisper log-mel [128, T] -> int32 ids [~T/4]; input 0 = feats [1, 128, T], input 1 = length [1]."""
        inputs = self._tokenizer.get_inputs()
        length: np.ndarray = np.array([feats.shape[1]], dtype=_numpy_dtype(inputs[1].type))
        out = self._tokenizer.run(
            None, {inputs[0].name: feats[None].astype(np.float32), inputs[1].name: length}
        )
        tokens = np.asarray(out[0]).reshape(-1)
        if tokens.size == 0:
            raise InvalidInput("the prompt is too short to yield any speech token")
        if tokens.min() < 0 or tokens.max() >= SPEECH_VOCAB:
            raise ModelError(f"speech tokenizer returned ids outside [0, {SPEECH_VOCAB}): wrong ONNX file?")
        return tokens.astype(np.int32)

    def _run_campplus(self, fbank: np.ndarray) -> np.ndarray:
        """Mean-normalised fbank [T, 80] -> speaker embedding float32 [192] (input 0 [1, T, 80])."""
        name = self._campplus.get_inputs()[0].name
        embedding = np.asarray(self._campplus.run(None, {name: fbank[None].astype(np.float32)})[0]).reshape(
            -1
        )
        if embedding.shape != (EMBEDDING_DIM,):
            raise ModelError(f"campplus returned {embedding.size} values, expected {EMBEDDING_DIM}")
        return embedding.astype(np.float32)

    def _once(self, key: str, wav16: np.ndarray, wav24: np.ndarray) -> PromptFeatures:
        """Cached features, or computed once for all requests that bring the same prompt at the same time
        (a wave of new visitors with one example voice): the first computes, the others wait for it."""
        with self._lock:
            features = self._cache.get(key)
            if features is not None:
                self._cache.move_to_end(key)
                return features
            running = self._running.get(key)
            if running is None:
                mine = self._running[key] = Future()
        if running is not None:
            return running.result()
        try:
            features = self._compute(wav16, wav24, key)
        except BaseException as err:
            with self._lock:
                del self._running[key]
            mine.set_exception(err)
            raise
        self._store(key, features)
        mine.set_result(features)
        return features

    def _store(self, key: str, features: PromptFeatures) -> None:
        with self._lock:
            del self._running[key]
            self._cache[key] = features
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)


def _content_hash(wav16: np.ndarray, wav24: np.ndarray) -> str:
    """sha256 of the decoded 16 kHz samples (and the 24 kHz ones, which feed the mel)."""
    digest = hashlib.sha256(np.ascontiguousarray(wav16, dtype=np.float32).tobytes())
    digest.update(np.ascontiguousarray(wav24, dtype=np.float32).tobytes())
    return digest.hexdigest()


def _numpy_dtype(onnx_type: str) -> type:
    return np.int64 if onnx_type == "tensor(int64)" else np.int32


def _session(path: str | os.PathLike[str], providers: list[str], threads: int, inputs: int) -> Any:
    """An onnxruntime session with the reference's options; a clear ModelError if the file is unusable."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    if not Path(path).is_file():
        raise ModelError(f"ONNX model not found: {path}")
    try:
        session = ort.InferenceSession(os.fspath(path), sess_options=options, providers=providers)
    except Exception as err:  # onnxruntime's errors derive from Exception only (InvalidProtobuf, Fail, ...)
        raise ModelError(f"cannot load ONNX model {path}: {err}") from err
    if len(session.get_inputs()) < inputs:
        raise ModelError(f"{path} has {len(session.get_inputs())} inputs; {inputs} expected")
    log.info("loaded %s on %s", Path(path).name, session.get_providers()[0])
    return session
