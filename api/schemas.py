"""Request and response bodies of the API (pydantic). Field names follow OpenAI's speech API; the
extensions (``ref_audio``, ``ref_text``, ``language``, ``seed``, ``mode``, ``stream``, ``source_audio``)
follow vLLM-Omni where it has the same idea."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from engine.request import Mode

ResponseFormat = Literal["wav", "mp3", "flac", "opus", "aac", "pcm"]
StreamFormat = Literal["audio", "sse"]


class VoiceRef(BaseModel):
    """OpenAI's object form of a custom voice: ``{"id": "..."}``."""

    id: str


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech``. Unknown fields are ignored, as OpenAI clients send newer ones. Numbers and
    booleans are strict: ``"speed": true`` or ``"stream": "yes"`` is refused, not read as 1.0 or True."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str
    voice: str | VoiceRef | None = None  # a saved voice id; ``ref_audio`` wins when both are given
    response_format: ResponseFormat = "wav"
    # OpenAI's range; the model does 0.5-2 itself, the rest is a time-stretch of its audio (api/stretch.py)
    speed: StrictFloat = Field(1.0, ge=0.25, le=4.0)
    # True: chunked bytes as produced; False: one file with exact sizes and RTF headers; None: per format
    # (flac whole, as a streamed FLAC cannot carry its length and libsndfile refuses such files).
    stream: StrictBool | None = None
    stream_format: StreamFormat = "audio"
    instructions: str = ""  # instruct mode's style text (CosyVoice instruct2)
    ref_audio: str | None = None  # base64 or data URL of the prompt speech
    ref_text: str = ""  # transcript of ref_audio (zero-shot needs it)
    source_audio: str | None = None  # base64 or data URL of the speech to convert (mode "vc")
    language: str = "auto"
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    mode: Mode | None = None  # default: vc with source_audio, instruct with instructions, else zero_shot
    # benchmarking extension: exactly this many speech tokens (25 a second); ignored unless the server
    # allows it (Limits.forced_tokens, app.py --allow-forced-tokens), and only then range-checked (1-3000)
    forced_tokens: StrictInt | None = None
    # a saved pronunciation lexicon (name or id, the caller's own or a public one): applied to ``input``
    # before synthesis (``api.lexicons``; the X-Lexicon-Applied header counts what it changed)
    lexicon: str | None = Field(None, max_length=64)

    def streams(self) -> bool:
        if self.stream_format == "sse":
            return True
        return self.stream if self.stream is not None else self.response_format != "flac"

    def voice_id(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    def resolved_mode(self) -> Mode:
        if self.mode is not None:
            return self.mode
        if self.source_audio:
            return Mode.VC
        return Mode.INSTRUCT if self.instructions.strip() else Mode.ZERO_SHOT


def _field(obj: Any, name: str, default: Any = None) -> Any:
    """Voice records may be dataclasses or mappings, depending on the engine."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


class VoiceInfo(BaseModel):
    """OpenAI's ``audio.voice`` object (id, name, created_at, type) and what this server adds: the
    transcript, the real duration, who may use it (``public``: every caller sees it; ``example``: one of
    the shipped example voices; both False: the caller's own) and the consent reference it was saved with."""

    object: Literal["audio.voice"] = "audio.voice"
    id: str
    name: str
    created_at: int  # unix seconds (an example voice: its recording's modification time)
    type: Literal["audio_sample"] = "audio_sample"
    prompt_text: str = ""
    duration_s: float
    public: bool
    example: bool = False
    consent: str = ""
    family: str | None = None  # the model family the voice was saved for
    compatible: bool = True  # False: saved for another family, not usable with the loaded model

    @classmethod
    def of(cls, voice: Any) -> VoiceInfo:
        voice_id = str(_field(voice, "id"))
        return cls(
            id=voice_id,
            name=str(_field(voice, "name", voice_id)),
            created_at=int(_field(voice, "created_at", 0) or 0),
            prompt_text=str(_field(voice, "prompt_text", "") or ""),
            duration_s=float(_field(voice, "duration_s", 0.0) or 0.0),
            public=bool(_field(voice, "public", True)),
            example=bool(_field(voice, "example", False)),
            consent=str(_field(voice, "consent", "") or ""),
            family=_field(voice, "family"),
            compatible=bool(_field(voice, "compatible", True)),
        )


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VoiceInfo]
    voices: list[str]  # vLLM-Omni's shape: the ids alone


class VoiceDeleted(BaseModel):
    """OpenAI's ``audio.voice.deleted``."""

    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    id: str
    deleted: bool = True


class ModelCard(BaseModel):
    """OpenAI's ``model`` object; ``kind`` says which routes take the id, ``root`` which model serves it."""

    object: Literal["model"] = "model"
    id: str
    created: int
    owned_by: str = "cosystream"
    kind: Literal["speech", "transcription"]
    root: str  # the loaded model (speech) or Whisper checkpoint (transcription) behind this id
    ready: bool
    family: str | None = None  # speech: cosyvoice2 / cosyvoice3
    sample_rate: int | None = None  # speech: the output rate, Hz


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
