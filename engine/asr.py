"""Prompt transcription with Whisper through ``transformers``: audio -> ``Transcript`` (text, language).

Loaded once on the engine's device (``Transcriber.load``); ``transcribe`` is blocking and serialised by a
lock, so callers run it in a worker thread (``TTSEngine.transcribe``) and synthesis never waits for it: it
takes no engine slot and no token2wav batch. One 30 s window at most (the prompt limit); the language is
detected by Whisper's own language-token step unless the caller names one the model knows. Transcription
has its own audio limits (``AUDIO_LIMITS``), not a voice prompt's: any rate from 4 kHz up (Whisper hears
16 kHz; telephone audio at 8 kHz is resampled), any length from one sample up, silence allowed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import device as devices
from engine.audio import AudioInput, AudioLimits, as_audio
from engine.errors import InvalidInput, ModelError
from engine.import_lock import transformers_import
from engine.serving.startup import Timeline
from engine.serving.subtitles import Word

log = logging.getLogger(__name__)

ASR_AUTO, ASR_NONE = "auto", "none"
GPU_DEFAULT = "openai/whisper-large-v3-turbo"  # large-v3 quality at 4 decoder layers; knows yue
CPU_DEFAULT = "openai/whisper-small"  # ~0.5 s for a 10 s prompt on a few CPU cores
SAMPLE_RATE = 16000  # Whisper's input rate
MAX_SECONDS = 30.0  # one Whisper window
MIN_RATE = 4000  # Hz; below this speech has lost most of what Whisper listens for
RATE_REASON = "transcription needs at least {min_rate} Hz (8 kHz telephone audio is fine)"


def audio_limits(max_bytes: int = AudioLimits.max_bytes) -> AudioLimits:
    """What a transcription accepts: ``max_bytes`` of file, up to one 30 s window at 4 kHz or more."""
    return AudioLimits(MAX_SECONDS, 0.0, max_bytes, min_rms=0.0, min_rate=MIN_RATE, rate_reason=RATE_REASON)


AUDIO_LIMITS = audio_limits()


@dataclass(frozen=True)
class Transcript:
    text: str
    language: str  # ISO 639 code Whisper detected or was given ("zh", "en", "yue", ...)
    duration_s: float  # of the input audio
    tokens: tuple[int, ...] = ()  # the decoded ids, special tokens included (OpenAI's segment tokens)
    avg_logprob: float = 0.0  # mean log-probability of the generated tokens (greedy decoding)
    no_speech_prob: float = 0.0  # Whisper's no-speech token probability at the first decoder step


def model_choice(choice: str, device: torch.device) -> str | None:
    """``--asr-model`` -> what to load: None when off, the GPU or CPU default for "auto", else as given."""
    if choice == ASR_NONE:
        return None
    if choice == ASR_AUTO:
        return GPU_DEFAULT if devices.is_accelerator(device) else CPU_DEFAULT
    return choice


def display_name(name: str) -> str:
    """How the API names an ASR model (``/v1/models``): a local folder by its own name, an id as it is."""
    return Path(name).name if Path(name).is_dir() else name


class Transcriber:
    def __init__(self, model: Any, processor: Any, device: torch.device, name: str):
        self.model, self.processor, self.device, self.name = model, processor, device, name
        self.dtype = next(model.parameters()).dtype
        generation = model.generation_config
        self.languages: dict[str, int] = {
            tok.strip("<|>"): int(i) for tok, i in (getattr(generation, "lang_to_id", None) or {}).items()
        }
        self._by_id = {i: code for code, i in self.languages.items()}
        self._max_new = int(model.config.max_target_positions) - 8  # room for the start/language/task tokens
        self._no_speech = no_speech_token(processor.tokenizer)
        self._lock = threading.Lock()
        self._pipeline: Any = None  # the word-timestamp pipeline over the same model, built on first use

    @classmethod
    def load(cls, name: str, device: torch.device) -> Transcriber:
        """A Hugging Face id (downloaded on first use) or a local folder in the released Whisper layout."""
        with transformers_import():  # the LM backend's start (vLLM) may be importing it on another thread
            from transformers import WhisperForConditionalGeneration, WhisperProcessor

        dtype = devices.default_dtype(device)
        try:
            processor = WhisperProcessor.from_pretrained(name)
            model = WhisperForConditionalGeneration.from_pretrained(name, dtype=dtype)
        except OSError as err:
            message = f"could not load the ASR model {name!r} ({err}); --asr-model none turns it off"
            raise ModelError(message) from err
        model.to(device).eval()
        log.info("loaded ASR model %s on %s (%s)", name, device, dtype)
        return cls(model, processor, device, display_name(name))

    def transcribe(self, audio: AudioInput, language: str | None = None) -> Transcript:
        """Text of up to 30 s of speech; ``language`` None or "auto" detects it."""
        clip = as_audio(audio, AUDIO_LIMITS, SAMPLE_RATE)
        inputs = self.processor(clip.at(SAMPLE_RATE), sampling_rate=SAMPLE_RATE, return_tensors="pt")
        features = inputs.input_features.to(self.device, self.dtype)  # [1, n_mels, 3000]
        with self._lock, torch.inference_mode():
            code = self._language(features, language)
            out = self.model.generate(
                features,
                language=code,
                task="transcribe",
                max_new_tokens=self._max_new,
                return_dict_in_generate=True,
                output_scores=True,
            )
            steps = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            no_speech = self._no_speech_prob(features)
        ids = out.sequences[0]
        text = self.processor.batch_decode(ids[None], skip_special_tokens=True)[0].strip()
        avg = float(steps[0].mean()) if steps.numel() else 0.0
        return Transcript(text, code, clip.duration_s, tuple(int(i) for i in ids), avg, no_speech)

    def _no_speech_prob(self, features: torch.Tensor) -> float:
        """P(no-speech token) after <|startoftranscript|>, as Whisper reports it (0 when the vocabulary has
        no such token)."""
        if self._no_speech is None:
            return 0.0
        start = torch.tensor([[self.model.generation_config.decoder_start_token_id]], device=self.device)
        logits = self.model(input_features=features, decoder_input_ids=start).logits[0, -1]
        return float(logits.float().softmax(-1)[self._no_speech])

    def words(self, pcm: np.ndarray, sample_rate: int, language: str | None = None) -> list[Word]:
        """Recognised words with times (s from the start of ``pcm``, up to 30 s), by the transformers
        pipeline's cross-attention alignment (``return_timestamps="word"``); the subtitles' word timer."""
        if not getattr(self.model.generation_config, "alignment_heads", None):
            return []  # a Whisper without cross-attention alignment heads has no word times
        clip = as_audio((pcm, sample_rate), AUDIO_LIMITS, SAMPLE_RATE)
        with self._lock, torch.inference_mode():
            if self._pipeline is None:
                from transformers import pipeline

                self._pipeline = pipeline(
                    "automatic-speech-recognition", model=self.model, tokenizer=self.processor.tokenizer,
                    feature_extractor=self.processor.feature_extractor, device=self.device,
                )  # fmt: skip
            code = language if language in self.languages else None
            kwargs = {"language": code, "task": "transcribe"} if code else {"task": "transcribe"}
            out = self._pipeline(
                clip.at(SAMPLE_RATE).copy(), return_timestamps="word", generate_kwargs=kwargs
            )
        return [_word(chunk, clip.duration_s) for chunk in out.get("chunks", []) if chunk["text"].strip()]

    def _language(self, features: torch.Tensor, language: str | None) -> str:
        if language and language != "auto":
            if language not in self.languages:
                known = ", ".join(sorted(self.languages))
                message = f"language {language!r} is not one the ASR model knows ({known})"
                raise InvalidInput(message, field="language")
            return language
        token = int(self.model.detect_language(features)[0])  # Whisper's language-token step
        return self._by_id.get(token, "en")


def _word(chunk: dict[str, Any], duration_s: float) -> Word:
    """A pipeline chunk ({"text", "timestamp": (start, end | None)}) -> Word (an open end: the clip's)."""
    start, end = chunk["timestamp"]
    start = float(start or 0.0)
    return Word(chunk["text"].strip(), start, float(end) if end is not None else max(start, duration_s))


def no_speech_token(tokenizer: Any) -> int | None:
    """The id of Whisper's no-speech token (``<|nospeech|>`` in v3, ``<|nocaptions|>`` before), if any."""
    for name in ("<|nospeech|>", "<|nocaptions|>"):
        token = tokenizer.convert_tokens_to_ids(name)
        if token is not None and token != tokenizer.unk_token_id:
            return int(token)
    return None


class LoadingAsr:
    """Whisper, loading on a thread of its own from ``start`` on (a background phase "whisper" on the
    start-up timeline): the engine serves speech meanwhile, and a transcription waits for it. A load that
    fails is logged, and every transcription then raises its error (the speech keeps being served)."""

    def __init__(self, name: str, loaded: Future[Transcriber]):
        self.name, self._loaded = name, loaded

    @classmethod
    def start(cls, name: str, dev: torch.device, timeline: Timeline) -> LoadingAsr:
        loaded: Future[Transcriber] = Future()
        timeline.queue("whisper")  # pending on /ready until it has loaded

        def load() -> None:
            try:
                with timeline.phase("whisper", background=True):
                    loaded.set_result(Transcriber.load(name, dev))
            except Exception as err:  # handed to every transcription; the load's thread ends here
                log.exception("the ASR model %s did not load: transcription is off", name)
                loaded.set_exception(err)

        threading.Thread(target=load, name="whisper-load", daemon=True).start()
        return cls(display_name(name), loaded)

    async def ready(self) -> Transcriber:
        """The loaded Whisper (its load's error if it failed)."""
        return await asyncio.wrap_future(self._loaded)

    def words(self, pcm: np.ndarray, sample_rate: int, language: str | None = None) -> list[Word]:
        """The subtitles' word timer (``Transcriber.words``), blocking until the load ends: called in a
        worker thread. A failed load raises RuntimeError, on which the words are spread by letters."""
        try:
            transcriber = self._loaded.result()
        except Exception as err:  # the load's own error, logged where it failed
            raise RuntimeError(f"the ASR model {self.name} did not load: {err}") from err
        return transcriber.words(pcm, sample_rate, language)
