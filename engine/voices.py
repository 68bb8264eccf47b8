"""Saved voices on disk: ``<root>/<id>/`` holds features.npz, meta.json and prompt.wav (a preview).

An entry is built in a hidden temporary directory and renamed into place, so a crash leaves either a whole
voice or none; deletion renames it away before removing it. The voice id is the directory name, a slug of
the display name. Features are family-specific (the v2 and v3 speech tokenizers differ), so voices saved
with another family are listed but flagged, and ``get`` refuses them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import unicodedata
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import audio as audio_io
from engine.audio import AudioInput
from engine.errors import InvalidInput, NotFound
from engine.frontend import PromptFeatures

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 64
MAX_PROMPT_TEXT_CHARS = 4096
FEATURES, META, PREVIEW = "features.npz", "meta.json", "prompt.wav"
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,79}$")
_TMP, _TRASH = ".tmp-", ".trash-"
_FORMAT = 1
_PREVIEW_LIMITS = audio_io.AudioLimits(max_seconds=60.0, min_rms=0.0)


@dataclass(frozen=True)
class Voice:
    """A saved voice's metadata; ``compatible`` is False when it was saved for another model family."""

    id: str
    name: str
    prompt_text: str
    family: str
    duration_s: float
    created_at: float  # unix seconds
    compatible: bool = True


class VoiceLibrary:
    """Thread-safe store of saved voices under ``root_dir`` for a model ``family`` (None = accept all)."""

    def __init__(self, root_dir: str | os.PathLike[str], family: str | None = None):
        self.root = Path(root_dir).expanduser()
        self.family = family
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sweep_leftovers()

    def add(
        self,
        name: str,
        features: PromptFeatures,
        prompt_text: str = "",
        family: str | None = None,
        preview: AudioInput | None = None,
    ) -> Voice:
        """Save a voice; its id is a slug of ``name`` made unique with -2, -3 ..."""
        name = validate_name(name)
        prompt_text = _validate_prompt_text(prompt_text)
        family = family or features.family
        if family != features.family:
            raise InvalidInput(f"features were extracted for {features.family}, not {family}")
        meta = {"format": _FORMAT, "name": name, "prompt_text": prompt_text, "family": family}
        meta |= {
            "duration_s": features.duration_s,
            "created_at": time.time(),
            "content_hash": features.content_hash,
        }
        staging = Path(tempfile.mkdtemp(prefix=_TMP, dir=self.root))
        try:
            _write_entry(staging, meta, features, preview)
            voice_id = self._publish(staging, slugify(name))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info("saved voice %s (%r, %s)", voice_id, name, family)
        return self._voice(voice_id, meta)

    def list(self) -> list[Voice]:
        """Every readable voice, sorted by name; a damaged entry is skipped with a warning."""
        voices = []
        for entry in _entries(self.root):
            try:
                voices.append(self._voice(entry.name, _read_meta(entry)))
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("skipping damaged voice entry %s: %s", entry, err)
        return sorted(voices, key=lambda v: (v.name.casefold(), v.id))

    def get(self, voice_id: str) -> tuple[Voice, PromptFeatures]:
        """The voice and its features; InvalidInput when it belongs to another family, NotFound if absent."""
        entry = self._entry(voice_id)
        try:
            voice = self._voice(voice_id, _read_meta(entry))
            features = _read_features(entry / FEATURES)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise NotFound(
                f"saved voice {voice_id!r} is damaged ({err}); delete it and save it again", field="voice_id"
            ) from err
        if not voice.compatible:
            raise InvalidInput(
                f"saved voice {voice_id!r} was made for {voice.family} but the loaded model is "
                f"{self.family}; save it again from its prompt audio",
                field="voice_id",
            )
        return voice, features

    def delete(self, voice_id: str) -> None:
        """Remove a voice (rename away first, so readers never see half an entry)."""
        with self._lock:
            entry = self._entry(voice_id)
            trash = self.root / f"{_TRASH}{voice_id}-{uuid.uuid4().hex[:8]}"
            os.rename(entry, trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("deleted voice %s", voice_id)

    def preview_path(self, voice_id: str) -> Path | None:
        """The stored prompt.wav, if the voice has one."""
        path = self._entry(voice_id) / PREVIEW
        return path if path.is_file() else None

    # ------------------------------------------------------------------------------------------ internals

    def _publish(self, staging: Path, slug: str) -> str:
        """Rename the complete staging directory to the first free id; the rename is the commit point."""
        with self._lock:
            for n in range(1, 10_000):
                voice_id = slug if n == 1 else f"{slug}-{n}"
                if (self.root / voice_id).exists():
                    continue
                os.rename(staging, self.root / voice_id)
                _fsync_dir(self.root)
                return voice_id
        raise InvalidInput(f"too many voices named like {slug!r}")

    def _entry(self, voice_id: str) -> Path:
        if not isinstance(voice_id, str) or not _ID.match(voice_id):
            message = f"invalid voice id {voice_id!r} (lowercase letters, digits and '-')"
            raise InvalidInput(message, field="voice_id")
        entry = self.root / voice_id
        if not entry.is_dir():
            raise NotFound(f"no saved voice with id {voice_id!r}", field="voice_id")
        return entry

    def _voice(self, voice_id: str, meta: dict[str, Any]) -> Voice:
        family = str(meta["family"])
        return Voice(
            id=voice_id,
            name=str(meta["name"]),
            prompt_text=str(meta["prompt_text"]),
            family=family,
            duration_s=float(meta["duration_s"]),
            created_at=float(meta["created_at"]),
            compatible=self.family is None or family == self.family,
        )

    def _sweep_leftovers(self) -> None:
        """Staging/trash directories left by a crash are garbage: remove them."""
        for path in self.root.iterdir():
            if path.is_dir() and path.name.startswith((_TMP, _TRASH)):
                log.warning("removing leftover %s", path)
                shutil.rmtree(path, ignore_errors=True)


def _entries(root: Path) -> list[Path]:
    """Voice directories (hidden staging/trash directories never match the id pattern)."""
    return [p for p in root.iterdir() if p.is_dir() and _ID.match(p.name)]


def validate_name(name: str) -> str:
    """A display name: 1-64 characters, no control/format characters. Path-like names are fine (the id is
    a slug), but NUL, newlines and other controls are refused."""
    if not isinstance(name, str):
        raise InvalidInput("voice name must be a string")
    name = unicodedata.normalize("NFC", name).strip()
    if not name:
        raise InvalidInput("voice name is empty")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidInput(f"voice name is {len(name)} characters; at most {MAX_NAME_CHARS} are allowed")
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        raise InvalidInput("voice name contains control characters")
    return name


def slugify(name: str) -> str:
    """ASCII id from a name: 'Alice (calm)' -> 'alice-calm'; names with no ASCII letters get a hash."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().lower()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_name).strip("-")[:48].strip("-")
    if slug:
        return slug
    return "voice-" + hashlib.sha256(name.encode()).hexdigest()[:8]


def _validate_prompt_text(text: str) -> str:
    if not isinstance(text, str) or "\x00" in text:
        raise InvalidInput("prompt text must be a string without NUL characters")
    if len(text) > MAX_PROMPT_TEXT_CHARS:
        raise InvalidInput(
            f"prompt text is {len(text)} characters; at most {MAX_PROMPT_TEXT_CHARS} are allowed"
        )
    return text


def _write_entry(
    directory: Path, meta: dict[str, Any], features: PromptFeatures, preview: AudioInput | None
) -> None:
    _atomic_write(directory / FEATURES, _features_bytes(features))
    if preview is not None:
        _atomic_write(directory / PREVIEW, _preview_bytes(preview))
    _atomic_write(directory / META, json.dumps(meta, ensure_ascii=False, indent=1).encode())
    _fsync_dir(directory)


def _features_bytes(features: PromptFeatures) -> bytes:
    buf = io.BytesIO()
    np.savez(
        buf,
        speech_tokens=features.speech_tokens,
        speaker_embedding=features.speaker_embedding,
        prompt_mel=features.prompt_mel,
        num_samples=np.int64(features.num_samples),
        sample_rate=np.int64(features.sample_rate),
        content_hash=np.str_(features.content_hash),
        family=np.str_(features.family),
        trimmed=np.bool_(features.trimmed),
    )
    return buf.getvalue()


def _read_features(path: Path) -> PromptFeatures:
    with np.load(path, allow_pickle=False) as data:
        return PromptFeatures(
            speech_tokens=data["speech_tokens"],
            speaker_embedding=data["speaker_embedding"],
            prompt_mel=data["prompt_mel"],
            num_samples=int(data["num_samples"]),
            content_hash=str(data["content_hash"]),
            family=str(data["family"]),
            trimmed=bool(data["trimmed"]),
            sample_rate=int(data["sample_rate"]),
        )


def _read_meta(entry: Path) -> dict[str, Any]:
    meta = json.loads((entry / META).read_text(encoding="utf-8"))
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"unknown meta.json format in {entry}")
    if not (entry / FEATURES).is_file():
        raise ValueError(f"{FEATURES} is missing")
    return meta


def _preview_bytes(preview: AudioInput) -> bytes:
    """Re-encode whatever was given as 16-bit WAV (user bytes are never stored verbatim)."""
    clip = audio_io.as_audio(preview, _PREVIEW_LIMITS, audio_io.PROMPT_SAMPLE_RATE)
    return audio_io.to_wav_bytes(clip.samples, clip.sample_rate)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write beside the target, flush to disk, then os.replace: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    """Persist a rename; directories cannot be opened for fsync on every OS, which is then skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
