"""Saved voices on disk: ``<root>/<id>/`` holds features.npz, meta.json and prompt.wav (a preview).

Public voices (the operator's) live at the root; a visitor's private voices live under
``<root>/_owners/<sha256(owner)[:32]>/<id>/`` (the owner string, a browser id or an API key, is never
written to disk). An owner sees the public voices and their own; nobody else's. Example voices are
``name.wav`` + ``name.txt`` pairs in an assets folder: public and read-only, their features are extracted
on use (the frontend caches them by content hash). Stock OpenAI voice names map onto the examples.

An entry is built in a hidden temporary directory and renamed into place, so a crash leaves either a whole
voice or none; deletion renames it away before removing it. The voice id is the directory name, a slug of
the display name; display names are unique among the voices an owner sees (examples, public voices and
their own: a clash is a ``Conflict``), so a name picks one voice. Features are family-specific (the v2 and
v3 speech tokenizers differ), so voices saved with another family are listed but flagged, and ``get``
refuses them.
"""

from __future__ import annotations

import builtins
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
from engine.errors import Conflict, Forbidden, InvalidInput, NotFound
from engine.frontend import PromptFeatures

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 64
MAX_PROMPT_TEXT_CHARS = 4096
MAX_CONSENT_CHARS = 256
FEATURES, META, PREVIEW = "features.npz", "meta.json", "prompt.wav"
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,79}$")
_TMP, _TRASH = ".tmp-", ".trash-"
_FORMAT = 1
OWNERS = "_owners"  # not a valid id (underscore), so the public listing never shows it
MAX_OWNER_CHARS = 256
DEFAULT_EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "assets" / "voices"
EXAMPLE_LANGUAGES = ("zh", "en", "ja", "ko", "yue")  # a file name "<lang>-<name>.wav" sets the language
# Stock OpenAI voice names -> example voice ids (assets/voices), so a stock client works with no set-up.
OPENAI_VOICES: dict[str, str] = {
    "alloy": "en-amy", "ash": "en-ben", "ballad": "en-ben", "coral": "en-amy", "echo": "en-ben",
    "fable": "en-amy", "onyx": "en-ben", "nova": "zh-lan", "sage": "zh-lan", "shimmer": "ja-yuki",
    "verse": "ko-minji", "marin": "yue-wing", "cedar": "en-ben",
}  # fmt: skip
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
    public: bool = True  # False: one owner's private voice
    example: bool = False  # an assets/ example: read-only, features extracted on use
    consent: str = ""  # the consent reference given when it was saved (OpenAI's consent recording id)


@dataclass(frozen=True)
class ExampleVoice:
    """A public example voice: a short recording and its transcript, in a known language (or "auto")."""

    id: str
    name: str
    language: str
    wav: Path
    transcript: str
    duration_s: float = 0.0  # of the recording
    created_at: float = 0.0  # unix seconds: the recording file's modification time

    def as_voice(self, family: str) -> Voice:
        return Voice(
            self.id, self.name, self.transcript, family, self.duration_s, self.created_at, example=True
        )


def load_examples(root: str | os.PathLike[str] | None = None) -> list[ExampleVoice]:
    """Every ``name.wav`` with a ``name.txt`` beside it, sorted by id; a pair that cannot be read is
    skipped with a warning (an operator's typo must not stop the server)."""
    folder = Path(root) if root is not None else DEFAULT_EXAMPLES_DIR
    if not folder.is_dir():
        return []
    examples = []
    for wav in sorted(folder.glob("*.wav")):
        try:
            examples.append(_example(wav))
        except (OSError, ValueError, InvalidInput) as err:
            log.warning("skipping example voice %s: %s", wav, err)
    return examples


def _example(wav: Path) -> ExampleVoice:
    transcript = _validate_prompt_text(wav.with_suffix(".txt").read_text(encoding="utf-8").strip())
    if not transcript:
        raise ValueError("its transcript is empty")
    name = validate_name(wav.stem)
    prefix = name.split("-", 1)[0].lower()
    language = prefix if prefix in EXAMPLE_LANGUAGES else "auto"
    import soundfile as sf  # lazy, as engine.audio does

    try:
        duration = float(sf.info(str(wav)).duration)
    except sf.LibsndfileError as err:
        raise ValueError(f"cannot read its audio ({err})") from err
    return ExampleVoice(slugify(name), name, language, wav, transcript, duration, wav.stat().st_mtime)


def check_owner(owner: str | None) -> str | None:
    """An owner is an opaque non-empty string (a browser id, an API key); None is the operator."""
    if owner is None:
        return None
    if not isinstance(owner, str) or not owner or len(owner) > MAX_OWNER_CHARS:
        raise InvalidInput(f"voice owner must be a string of 1-{MAX_OWNER_CHARS} characters")
    return owner


def owner_dir_name(owner: str) -> str:
    """The owner's folder: a hash, so no key or browser id is stored in clear on disk."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class VoiceLibrary:
    """Thread-safe store of saved voices under ``root_dir`` for a model ``family`` (None = accept all).

    Every method takes ``owner``: None is the operator (the public voices), a string is one visitor's
    namespace. ``examples`` are the read-only public example voices (``load_examples``).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        family: str | None = None,
        examples: list[ExampleVoice] | None = None,
    ):
        self.root = Path(root_dir).expanduser()
        self.family = family
        self.examples = {e.id: e for e in examples or []}
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
        owner: str | None = None,
        consent: str = "",
    ) -> Voice:
        """Save a voice in ``owner``'s namespace (None: public); its id is a slug of ``name`` made unique
        with -2, -3 ... among the voices that owner can see. A ``name`` the owner already sees (their own, a
        public or an example voice, compared case-insensitively) is a ``Conflict``. ``consent``: the
        speaker's consent reference, stored and shown with the voice."""
        name = validate_name(name)
        check_not_stock(name)
        prompt_text = _validate_prompt_text(prompt_text)
        consent = _validate_consent(consent)
        folder = self._folder(check_owner(owner), create=True)
        family = family or features.family
        if family != features.family:
            raise InvalidInput(f"features were extracted for {features.family}, not {family}")
        meta = {"format": _FORMAT, "name": name, "prompt_text": prompt_text, "family": family}
        meta |= {"consent": consent} if consent else {}
        meta |= {
            "duration_s": features.duration_s,
            "created_at": time.time(),
            "content_hash": features.content_hash,
        }
        staging = Path(tempfile.mkdtemp(prefix=_TMP, dir=folder))
        try:
            _write_entry(staging, meta, features, preview)
            voice_id = self._publish(staging, folder, name, owner)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        scope = "public" if owner is None else "private"
        log.info("saved voice %s (%r, %s, %s)", voice_id, name, family, scope)
        return self._voice(voice_id, meta, public=owner is None)

    def list(self, owner: str | None = None) -> list[Voice]:
        """What ``owner`` may use: the examples, the public voices and their own, sorted by name."""
        voices = [e.as_voice(self.family or "") for e in self.examples.values()]
        voices += self._list(self.root, public=True)
        if check_owner(owner) is not None:
            voices += self._list(self._folder(owner), public=False)
        return sorted(voices, key=lambda v: (v.name.casefold(), v.public, v.id))

    def get(self, voice_id: str, owner: str | None = None) -> tuple[Voice, PromptFeatures]:
        """The voice and its features, the owner's own first, then the public one; InvalidInput when it
        belongs to another family, NotFound when absent (or another owner's: nobody learns it exists)."""
        entry, public = self._find(voice_id, check_owner(owner))
        try:
            voice = self._voice(voice_id, _read_meta(entry), public)
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

    def example(self, voice_id: str, owner: str | None = None) -> ExampleVoice | None:
        """The example ``voice_id`` (or the stock OpenAI name) names, unless a saved voice the owner can
        see has that id (saved voices win; a stock name is never a saved voice's: ``check_not_stock``)."""
        if not isinstance(voice_id, str):
            return None
        key = OPENAI_VOICES.get(voice_id.lower(), voice_id)
        if key not in self.examples:
            return None
        try:
            self._find(voice_id, check_owner(owner))
        except (NotFound, InvalidInput):
            return self.examples[key]
        return None

    def delete(self, voice_id: str, owner: str | None = None) -> None:
        """Remove one of ``owner``'s voices (None: a public one). Examples and, for a visitor, public
        voices are read-only (Forbidden); another owner's voice is NotFound."""
        owner = check_owner(owner)
        if voice_id in self.examples:
            raise Forbidden(
                f"{voice_id!r} is an example voice: remove its files from the assets folder", field="voice_id"
            )
        with self._lock:
            entry, public = self._find(voice_id, owner)
            if public and owner is not None:
                raise Forbidden(
                    f"voice {voice_id!r} is public: only the operator can delete it", field="voice_id"
                )
            trash = entry.parent / f"{_TRASH}{voice_id}-{uuid.uuid4().hex[:8]}"
            os.rename(entry, trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("deleted voice %s", voice_id)

    def preview_path(self, voice_id: str, owner: str | None = None) -> Path | None:
        """The stored prompt.wav, if the voice has one."""
        path = self._find(voice_id, check_owner(owner))[0] / PREVIEW
        return path if path.is_file() else None

    # ------------------------------------------------------------------------------------------ internals

    def _folder(self, owner: str | None, create: bool = False) -> Path:
        if owner is None:
            return self.root
        folder = self.root / OWNERS / owner_dir_name(owner)
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _find(self, voice_id: str, owner: str | None) -> tuple[Path, bool]:
        """(entry folder, is public): the owner's own entry first, then the public one."""
        if not isinstance(voice_id, str) or not _ID.match(voice_id):
            raise InvalidInput(
                f"invalid voice id {voice_id!r} (lowercase letters, digits and '-')", field="voice_id"
            )
        if owner is not None and (self._folder(owner) / voice_id).is_dir():
            return self._folder(owner) / voice_id, False
        if (self.root / voice_id).is_dir():
            return self.root / voice_id, True
        raise NotFound(f"no saved voice with id {voice_id!r}", field="voice_id")

    def _list(self, folder: Path, public: bool) -> builtins.list[Voice]:
        voices = []
        for entry in _entries(folder):
            try:
                voices.append(self._voice(entry.name, _read_meta(entry), public))
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("skipping damaged voice entry %s: %s", entry, err)
        return voices

    def _publish(self, staging: Path, folder: Path, name: str, owner: str | None) -> str:
        """Rename the complete staging directory to the first free id; the rename is the commit point.
        Ids taken publicly or by an example are skipped too, so an owner's ids never shadow them. The name
        check and the rename share the lock, so two concurrent saves of one name cannot both succeed."""
        slug = slugify(name)
        with self._lock:
            self._check_name_free(name, owner)
            for n in range(1, 10_000):
                voice_id = slug if n == 1 else f"{slug}-{n}"
                taken = (folder / voice_id).exists() or (self.root / voice_id).exists()
                if taken or voice_id in self.examples:
                    continue
                os.rename(staging, folder / voice_id)
                _fsync_dir(folder)
                return voice_id
        raise InvalidInput(f"too many voices named like {slug!r}")

    def _check_name_free(self, name: str, owner: str | None) -> None:
        key = name.casefold()
        for voice in self.list(owner):
            if voice.name.casefold() == key:
                kind = (
                    "an example voice"
                    if voice.example
                    else "a public voice"
                    if voice.public
                    else "your voice"
                )
                raise Conflict(
                    f"{kind} is already named {voice.name!r} (id {voice.id!r}): choose another name"
                    + ("" if voice.public else " or delete that voice first"),
                    field="name",
                )

    def _voice(self, voice_id: str, meta: dict[str, Any], public: bool = True) -> Voice:
        family = str(meta["family"])
        return Voice(
            id=voice_id,
            name=str(meta["name"]),
            prompt_text=str(meta["prompt_text"]),
            family=family,
            duration_s=float(meta["duration_s"]),
            created_at=float(meta["created_at"]),
            compatible=self.family is None or family == self.family,
            public=public,
            consent=str(meta.get("consent", "")),
        )

    def _sweep_leftovers(self) -> None:
        """Staging/trash directories left by a crash are garbage: remove them (every namespace)."""
        owners = self.root / OWNERS
        folders = [self.root, *(p for p in owners.iterdir() if p.is_dir())] if owners.is_dir() else []
        folders = folders or [self.root]
        for folder in folders:
            for path in folder.iterdir():
                if path.is_dir() and path.name.startswith((_TMP, _TRASH)):
                    log.warning("removing leftover %s", path)
                    shutil.rmtree(path, ignore_errors=True)


def _entries(root: Path) -> list[Path]:
    """Voice directories (hidden staging/trash directories and ``_owners`` never match the id pattern)."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and _ID.match(p.name)]


def validate_name(name: str) -> str:
    """A display name: 1-64 characters, no control/format characters. Path-like names are fine (the id is
    a slug), but NUL, newlines and other controls are refused."""
    if not isinstance(name, str):
        raise InvalidInput("voice name must be a string", field="name")
    name = unicodedata.normalize("NFC", name).strip()
    if not name:
        raise InvalidInput("voice name is empty", field="name")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidInput(
            f"voice name is {len(name)} characters; at most {MAX_NAME_CHARS} are allowed", field="name"
        )
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        raise InvalidInput("voice name contains control characters", field="name")
    return name


def check_not_stock(name: str) -> None:
    """The stock OpenAI names (alloy, nova ...) are reserved: a voice saved as ``alloy`` would replace the
    stock one for every client that shares its namespace (every client, on a server without keys)."""
    if name.strip().casefold() in OPENAI_VOICES or slugify(name) in OPENAI_VOICES:
        stock = ", ".join(OPENAI_VOICES)
        raise Conflict(f"{name!r} is a stock voice name ({stock}): choose another name", field="name")


def slugify(name: str) -> str:
    """ASCII id from a name: 'Alice (calm)' -> 'alice-calm'; names with no ASCII letters get a hash."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().lower()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_name).strip("-")[:48].strip("-")
    if slug:
        return slug
    return "voice-" + hashlib.sha256(name.encode()).hexdigest()[:8]


def _validate_consent(consent: str) -> str:
    if not isinstance(consent, str):
        raise InvalidInput("consent must be a string", field="consent")
    consent = consent.strip()
    if len(consent) > MAX_CONSENT_CHARS or any(unicodedata.category(ch).startswith("C") for ch in consent):
        raise InvalidInput(
            f"consent must be at most {MAX_CONSENT_CHARS} printable characters", field="consent"
        )
    return consent


def _validate_prompt_text(text: str) -> str:
    if not isinstance(text, str) or "\x00" in text:
        raise InvalidInput("prompt text must be a string without NUL characters", field="prompt_text")
    if len(text) > MAX_PROMPT_TEXT_CHARS:
        raise InvalidInput(
            f"prompt text is {len(text)} characters; at most {MAX_PROMPT_TEXT_CHARS} are allowed",
            field="prompt_text",
        )
    return text


def _write_entry(
    directory: Path, meta: dict[str, Any], features: PromptFeatures, preview: AudioInput | None
) -> None:
    atomic_write(directory / FEATURES, _features_bytes(features))
    if preview is not None:
        atomic_write(directory / PREVIEW, _preview_bytes(preview))
    atomic_write(directory / META, json.dumps(meta, ensure_ascii=False, indent=1).encode())
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


def atomic_write(path: Path, data: bytes) -> None:
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
