"""Pronunciation lexicons: per owner, a word or name -> how to say it, applied to the text before synthesis.

A hint is one of (``kind``):

- ``pinyin`` (CosyVoice3): syllables with tone numbers 1-5 or tone marks, e.g. ``ji3`` / ``jǐ`` for 给 in
  给予. Each syllable becomes the released tokenizer's initial and tone-marked final tokens, the form of the
  official example's hot-fix ``[j][ǐ]`` (FunAudioLLM/CosyVoice example.py); a zero-initial syllable is one
  token (``er2`` -> ``[ér]``).
- ``arpabet`` (CosyVoice3): CMU phones with stress digits, e.g. ``N AY1 K IY0`` -> ``[N][AY1][K][IY0]``.
- ``tokens`` (CosyVoice3): the bracketed tokens themselves, ``[j][ǐ]``, checked one by one.
- ``respell`` (both families; the only kind CosyVoice2 has, whose tokenizer has no phone tokens): plain text
  said instead of the word, e.g. ``Nye-key``.
- ``auto`` picks one of them from the hint's look (``detect_kind``).

Every token must be one of the family's special tokens (``engine/text/special_tokens.json``, the released
list): an unknown phone or a pinyin syllable with no token is an ``InvalidInput`` naming it.

Matching (``Lexicon.apply``): words with a CJK character match anywhere (Chinese has no spaces between
words); other words match whole words only (no Latin letter or digit right before or after them), ignoring
case unless the entry says ``match_case``. Longer words win over shorter ones that start at the same place;
text inside existing ``[...]`` tags and ``<...>`` markup is never rewritten.

On disk: ``<voices root>/_lexicons/<id>.json`` for the operator's (public, read-only to visitors) and
``<voices root>/_owners/<sha256(owner)[:32]>/_lexicons/<id>.json`` beside an owner's voices; the id is a
slug of the name. An owner sees the public lexicons and their own, nobody else's.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import threading
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import Conflict, Forbidden, InvalidInput, NotFound, TooLarge
from engine.text.frontend import FAMILIES
from engine.text.script import Part, Speech, pronunciation_tokens
from engine.voices import OWNERS, atomic_write, check_owner, owner_dir_name, slugify, validate_name

log = logging.getLogger(__name__)

KINDS = ("auto", "pinyin", "arpabet", "tokens", "respell")
FOLDER = "_lexicons"  # not a voice id (underscore): the voice listing never shows it
MAX_ENTRIES = 500
MAX_WORD_CHARS = 64
MAX_HINT_CHARS = 256
MAX_LEXICONS = 100  # per owner
_FORMAT = 1
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,79}$")
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_TOKEN = re.compile(r"\[[^\[\]\s]+\]")
_PROTECTED = re.compile(r"\[[^\[\]]*\]|<[^<>]*>")  # tags already in the text: never rewritten
# whole-word edges of a non-CJK word: no Latin letter or digit right beside it
_EDGE_BEFORE, _EDGE_AFTER = r"(?<![0-9A-Za-z\u00c0-\u024f])", r"(?![0-9A-Za-z\u00c0-\u024f])"
_ARPABET_PIECE = re.compile(r"^[A-Za-z]{1,2}[0-2]?$")
_UPPER_PIECE = re.compile(r"^[A-Z]+[0-9]*$")  # what a user means as ARPAbet, checked by _arpabet
_PINYIN_PIECE = re.compile(r"^[a-zü:vāáǎàēéěèīíǐìōóǒòūúǔùǖǘǚǜ]+[0-9]?$")
# pinyin initials, longest first (zh before z); y and w are tokens of their own in the released list
_INITIALS = ("zh", "ch", "sh", "b", "p", "m", "f", "d", "t", "n", "l", "g", "k", "h", "j", "q", "x", "r", "z",
             "c", "s", "y", "w")  # fmt: skip
_MARKS = {"a": "āáǎà", "e": "ēéěè", "i": "īíǐì", "o": "ōóǒò", "u": "ūúǔù", "ü": "ǖǘǚǜ"}
_UNMARK = {m: (base, tone + 1) for base, marks in _MARKS.items() for tone, m in enumerate(marks)}


@dataclass(frozen=True)
class Entry:
    """One word and its hint as the owner wrote them, and ``say``: what replaces the word in the text."""

    word: str
    hint: str
    kind: str
    say: str
    match_case: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"word": self.word, "hint": self.hint, "kind": self.kind, "match_case": self.match_case}


@dataclass(frozen=True)
class Hit:
    """Where an entry was applied: ``text[start:end]`` (offsets in the text before) became ``say``."""

    word: str
    matched: str
    say: str
    start: int
    end: int


@dataclass(frozen=True)
class Applied:
    """The text with the hints in place and every place an entry was applied, in text order."""

    text: str
    hits: tuple[Hit, ...]

    def counts(self) -> dict[str, int]:
        """Entry word -> how many times it was applied."""
        out: dict[str, int] = {}
        for hit in self.hits:
            out[hit.word] = out.get(hit.word, 0) + 1
        return out


@dataclass(frozen=True)
class Lexicon:
    id: str
    name: str
    entries: tuple[Entry, ...]
    public: bool = False
    updated_at: float = 0.0  # unix seconds

    def apply(self, text: str) -> Applied:
        """``text`` with each entry's word replaced by its hint (module docstring: the matching rules)."""
        if not self.entries or not text:
            return Applied(text, ())
        pattern = _pattern(self.entries)
        out, hits, pos = [], [], 0
        for free_start, free_end in _unprotected(text):
            for m in pattern.finditer(text, free_start, free_end):
                entry = self.entries[int(m.lastgroup[1:])] if m.lastgroup else None
                if entry is None:
                    continue
                out += [text[pos : m.start()], entry.say]
                hits.append(Hit(entry.word, m.group(), entry.say, m.start(), m.end()))
                pos = m.end()
        out.append(text[pos:])
        return Applied("".join(out), tuple(hits))

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "public": self.public, "entries": len(self.entries)}


class StreamApplier:
    """A lexicon applied to text that arrives in pieces (the realtime socket): ``feed`` returns the text that
    can no longer change, ``end`` the rest. Held back: a trailing Latin word (it may go on), the longest tail
    that starts or is some entry's word ("New" of "New York", "给" of "给予"), and an unclosed ``[`` or ``<``.
    The joined output equals ``lexicon.apply`` of the joined input."""

    def __init__(self, lexicon: Lexicon):
        self.lexicon, self.buffer = lexicon, ""
        self.hits: list[Hit] = []
        words = [e.word.casefold() for e in lexicon.entries]
        self._starts = sorted({w[:n] for w in words for n in range(1, len(w) + 1)})

    def feed(self, piece: str) -> str:
        self.buffer += piece
        cut = len(self.buffer) - self._held()
        return self._emit(cut)

    def end(self) -> str:
        return self._emit(len(self.buffer))

    def _emit(self, cut: int) -> str:
        ready, self.buffer = self.buffer[:cut], self.buffer[cut:]
        done = self.lexicon.apply(ready)
        self.hits += done.hits
        return done.text

    def _held(self) -> int:
        text = self.buffer
        word = re.search(r"[0-9A-Za-z\u00c0-\u024f]+$", text)
        held = len(word.group()) if word else 0
        folded = text.casefold()
        held = max([held, *(len(s) for s in self._starts if folded.endswith(s))])
        opened = max(text.rfind("["), text.rfind("<"))
        if opened > max(text.rfind("]"), text.rfind(">")):
            held = max(held, len(text) - opened)
        return min(held, len(text))


def apply_to_parts(lexicon: Lexicon, parts: Sequence[Part]) -> tuple[list[Part], Applied]:
    """A script's parts with ``lexicon`` applied to each spoken part's text (speaker names, voices,
    instructions and pauses are never rewritten), and every hit together (offsets within each part; the
    ``Applied`` text is empty: there is no one text)."""
    out: list[Part] = []
    hits: list[Hit] = []
    for part in parts:
        if isinstance(part, Speech):
            done = lexicon.apply(part.text)
            hits += done.hits
            part = replace(part, text=done.text)
        out.append(part)
    return out, Applied("", tuple(hits))


def _pattern(entries: tuple[Entry, ...]) -> re.Pattern[str]:
    """One alternation, longest word first, each alternative a named group ``e<index>``."""
    order = sorted(range(len(entries)), key=lambda i: -len(entries[i].word))
    parts = []
    for i in order:
        e = entries[i]
        core = re.escape(e.word) if e.match_case else f"(?i:{re.escape(e.word)})"
        parts.append(
            f"(?P<e{i}>{core})" if _CJK.search(e.word) else f"(?P<e{i}>{_EDGE_BEFORE}{core}{_EDGE_AFTER})"
        )
    return re.compile("|".join(parts))


def _unprotected(text: str) -> list[tuple[int, int]]:
    """The (start, end) stretches of ``text`` outside ``[...]`` tags and ``<...>`` markup."""
    spans, pos = [], 0
    for m in _PROTECTED.finditer(text):
        spans.append((pos, m.start()))
        pos = m.end()
    spans.append((pos, len(text)))
    return [(a, b) for a, b in spans if b > a]


# ------------------------------------------------------------------------------------------ hints


def detect_kind(hint: str) -> str:
    """``tokens`` for bracketed tokens, ``arpabet`` for upper-case phones, ``pinyin`` for syllables with a
    tone (number or mark), else ``respell``."""
    hint = hint.strip()
    if hint and not _TOKEN.sub("", hint).strip():
        return "tokens"
    pieces = hint.split()
    if pieces and all(_UPPER_PIECE.match(p) for p in pieces):
        return "arpabet"
    toned = all(_PINYIN_PIECE.match(p) and (p[-1].isdigit() or any(c in _UNMARK for c in p)) for p in pieces)
    if pieces and toned:
        return "pinyin"
    return "respell"


def hint_text(word: str, hint: str, kind: str, family: str) -> str:
    """What replaces ``word``: the tokens (pinyin, arpabet, tokens) or the respelling. InvalidInput names
    the phone or syllable that has no token in ``family``'s tokenizer."""
    if kind not in KINDS:
        raise InvalidInput(f"unknown hint kind {kind!r}; expected one of {', '.join(KINDS)}", field="kind")
    if family not in FAMILIES:
        raise InvalidInput(f"unknown model family {family!r}", field="family")
    hint = unicodedata.normalize("NFC", hint).strip()
    kind = detect_kind(hint) if kind == "auto" else kind
    if kind == "respell":
        return _respelling(word, hint)
    if family != "cosyvoice3":
        raise InvalidInput(
            f"{word!r}: {family} has no phone or pinyin tokens; give a respelling (kind 'respell')",
            field="hint",
        )
    vocab = pronunciation_tokens(family)
    if kind == "arpabet":
        return "".join(_arpabet(word, p, vocab) for p in hint.replace("-", " ").split())
    if kind == "pinyin":
        return "".join(_pinyin(word, p, vocab) for p in hint.replace("'", " ").split())
    return _tokens(word, hint, vocab)


def _respelling(word: str, hint: str) -> str:
    if any(c in hint for c in "[]<>") or any(unicodedata.category(c).startswith("C") for c in hint):
        raise InvalidInput(
            f"{word!r}: a respelling is plain text (no brackets, tags or controls)", field="hint"
        )
    return hint


def _arpabet(word: str, phone: str, vocab: frozenset[str]) -> str:
    token = f"[{phone.upper()}]"
    if token not in vocab or not _ARPABET_PIECE.match(phone):
        raise InvalidInput(
            f"{word!r}: unknown ARPAbet phoneme {phone!r} (CMU phones such as AA1, N, IY0; vowels take a "
            "stress digit 0-2)",
            field="hint",
        )
    return token


def _tokens(word: str, hint: str, vocab: frozenset[str]) -> str:
    rest = _TOKEN.sub("", hint).strip()
    if rest:
        raise InvalidInput(f"{word!r}: {rest!r} is not a [token]", field="hint")
    for token in _TOKEN.findall(hint):
        if token not in vocab:
            raise InvalidInput(f"{word!r}: {token} is not a CosyVoice3 phone or pinyin token", field="hint")
    return "".join(_TOKEN.findall(hint))


def _pinyin(word: str, syllable: str, vocab: frozenset[str]) -> str:
    """One syllable (``ji3``, ``jǐ``, ``lv4``, ``lü4``, ``ma5``/``ma``) -> ``[j][ǐ]``."""
    bare, tone = _tone_number(syllable.lower().replace("u:", "ü").replace("v", "ü"))
    if not bare or not tone:
        raise InvalidInput(f"{word!r}: {syllable!r} is not a pinyin syllable with a tone 1-5", field="hint")
    initial = next((i for i in _INITIALS if bare.startswith(i) and len(bare) > len(i)), "")
    final = _with_tone(bare[len(initial) :], tone)
    tokens = [f"[{initial}]"] if initial else []
    # the released list spells one final with v (vè): try both spellings of ü
    candidates = [f"[{final}]", f"[{final.replace('ü', 'v')}]"]
    found = next((c for c in candidates if c in vocab and c.strip("[]") not in _INITIALS), None)
    if found is None or any(t not in vocab for t in tokens):
        raise InvalidInput(
            f"{word!r}: pinyin syllable {syllable!r} has no CosyVoice3 token (its final {final!r} is not "
            "in the released list)",
            field="hint",
        )
    return "".join([*tokens, found])


def _tone_number(syllable: str) -> tuple[str, int]:
    """(letters without tone marks, tone 1-5); (x, 0) when the tone is missing or given twice."""
    if syllable and syllable[-1].isdigit():
        marks = [c for c in syllable[:-1] if c in _UNMARK]
        return (syllable[:-1], int(syllable[-1])) if not marks and syllable[-1] in "12345" else ("", 0)
    marks = [c for c in syllable if c in _UNMARK]
    if len(marks) > 1:
        return "", 0
    if not marks:  # no tone written: the neutral tone
        return syllable, 5 if syllable.isalpha() else 0
    base, tone = _UNMARK[marks[0]]
    return syllable.replace(marks[0], base), tone


def _with_tone(final: str, tone: int) -> str:
    """Put the tone mark where pinyin puts it: on a or e, on the o of ou, else on the last vowel."""
    if tone == 5:
        return final
    vowels = [i for i, c in enumerate(final) if c in _MARKS]
    if not vowels:
        return final
    at = next((final.index(v) for v in "ae" if v in final), None)
    if at is None:
        at = final.index("o") if "ou" in final else vowels[-1]
    return final[:at] + _MARKS[final[at]][tone - 1] + final[at + 1 :]


def make_entry(
    word: Any, hint: Any, kind: Any = "auto", family: str = "cosyvoice3", match_case: Any = False
) -> Entry:
    """A checked entry; InvalidInput names what is wrong with it."""
    if not isinstance(word, str) or not isinstance(hint, str):
        raise InvalidInput("an entry's word and hint must be strings", field="entries")
    word = unicodedata.normalize("NFC", word).strip()
    if not word or len(word) > MAX_WORD_CHARS:
        raise InvalidInput(
            f"an entry's word must have 1-{MAX_WORD_CHARS} characters, got {word!r}", field="word"
        )
    if any(c in word for c in "[]<>") or any(unicodedata.category(c).startswith("C") for c in word):
        raise InvalidInput(f"word {word!r} has brackets, tags or control characters", field="word")
    if not hint.strip() or len(hint) > MAX_HINT_CHARS:
        raise InvalidInput(f"{word!r}: the hint must have 1-{MAX_HINT_CHARS} characters", field="hint")
    if not isinstance(kind, str) or not isinstance(match_case, bool):
        raise InvalidInput(f"{word!r}: kind must be a string and match_case a boolean", field="kind")
    hint = unicodedata.normalize("NFC", hint).strip()
    resolved = detect_kind(hint) if kind == "auto" else kind
    return Entry(word, hint, resolved, hint_text(word, hint, resolved, family), match_case)


def make_entries(raw: Any, family: str) -> tuple[Entry, ...]:
    """Entries from JSON-like data (a list of {word, hint, kind?, match_case?}); one word once per lexicon."""
    if not isinstance(raw, list):
        raise InvalidInput("entries must be a list of {word, hint}", field="entries")
    if len(raw) > MAX_ENTRIES:
        raise TooLarge(f"a lexicon holds at most {MAX_ENTRIES} entries, got {len(raw)}", field="entries")
    entries, seen = [], set()
    for item in raw:
        if not isinstance(item, dict):
            raise InvalidInput("each entry must be an object {word, hint}", field="entries")
        entry = make_entry(
            item.get("word"),
            item.get("hint"),
            item.get("kind", "auto"),
            family,
            item.get("match_case", False),
        )
        key = entry.word if entry.match_case else entry.word.casefold()
        if key in seen:
            raise InvalidInput(f"word {entry.word!r} appears twice", field="word")
        seen.add(key)
        entries.append(entry)
    return tuple(entries)


# ------------------------------------------------------------------------------------------ storage


class LexiconLibrary:
    """Thread-safe store of lexicons beside the saved voices under ``root`` (``VoiceLibrary.root``); entries
    are checked against ``family``'s tokenizer when saved and again when read (a lexicon saved under the
    other family is refused with the entry named)."""

    def __init__(self, root: str | os.PathLike[str], family: str):
        self.root, self.family = Path(root).expanduser(), family
        self._lock = threading.Lock()

    def save(self, name: str, entries: Any, owner: str | None = None, replace: bool = False) -> Lexicon:
        """Create (``replace`` False: a name the owner already has is a Conflict) or replace one of the
        owner's lexicons (None: a public one); returns it."""
        name = validate_name(name)
        checked = make_entries(entries, self.family)
        owner = check_owner(owner)
        folder = self._folder(owner)
        lex_id = slugify(name)
        with self._lock:
            path = folder / f"{lex_id}.json"
            if path.exists() and not replace:
                raise Conflict(
                    f"you already have a lexicon named like {name!r} (id {lex_id!r})", field="name"
                )
            if not path.exists() and len(_files(folder)) >= MAX_LEXICONS:
                raise TooLarge(f"at most {MAX_LEXICONS} lexicons per owner", field="name")
            updated = time.time()
            data: dict[str, Any] = {"format": _FORMAT, "name": name, "updated_at": updated}
            data["entries"] = [e.as_json() for e in checked]
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(data, ensure_ascii=False, indent=1).encode())
        log.info(
            "saved lexicon %s (%d entries, %s)",
            lex_id,
            len(checked),
            "public" if owner is None else "private",
        )
        return Lexicon(lex_id, name, checked, owner is None, updated)

    def list(self, owner: str | None = None) -> builtins.list[Lexicon]:
        """The public lexicons and ``owner``'s own, sorted by name (damaged files are skipped, logged)."""
        found = self._read_all(self._folder(None), True)
        if check_owner(owner) is not None:
            found += self._read_all(self._folder(owner), False)
        return sorted(found, key=lambda x: (x.name.casefold(), x.public))

    def get(self, lexicon: str, owner: str | None = None) -> Lexicon:
        """By id or name: the owner's own first, then a public one; NotFound otherwise (another owner's
        lexicon is NotFound too: nobody learns it exists)."""
        owner = check_owner(owner)
        if not isinstance(lexicon, str) or not lexicon.strip():
            raise InvalidInput("lexicon must be a non-empty name or id", field="lexicon")
        for folder, public in self._scopes(owner):
            path = self._path(folder, lexicon)
            if path is not None:
                return self._read(path, public)
        raise NotFound(f"no lexicon {lexicon!r}", field="lexicon")

    def delete(self, lexicon: str, owner: str | None = None) -> None:
        owner = check_owner(owner)
        with self._lock:
            path = self._path(self._folder(owner), lexicon)
            if path is None:
                if owner is not None and self._path(self._folder(None), lexicon) is not None:
                    raise Forbidden(
                        f"lexicon {lexicon!r} is public: only the operator can delete it", field="lexicon"
                    )
                raise NotFound(f"no lexicon {lexicon!r}", field="lexicon")
            path.unlink()
        log.info("deleted lexicon %s", path.stem)

    # ------------------------------------------------------------------------------------ internals

    def _folder(self, owner: str | None) -> Path:
        if owner is None:
            return self.root / FOLDER
        return self.root / OWNERS / owner_dir_name(owner) / FOLDER

    def _scopes(self, owner: str | None) -> builtins.list[tuple[Path, bool]]:
        scopes = [(self._folder(owner), False)] if owner is not None else []
        return [*scopes, (self._folder(None), True)]

    def _path(self, folder: Path, lexicon: str) -> Path | None:
        """The file of the lexicon with this id, or else with this name (case-insensitive)."""
        if _ID.match(lexicon) and (folder / f"{lexicon}.json").is_file():
            return folder / f"{lexicon}.json"
        slug = slugify(lexicon.strip())
        path = folder / f"{slug}.json"
        return path if path.is_file() else None

    def _read_all(self, folder: Path, public: bool) -> builtins.list[Lexicon]:
        found = []
        for path in _files(folder):
            try:
                found.append(self._read(path, public))
            except InvalidInput as err:
                log.warning("skipping lexicon %s: %s", path, err)
        return found

    def _read(self, path: Path, public: bool) -> Lexicon:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise ValueError("unknown format")
            name, updated = str(data["name"]), float(data["updated_at"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InvalidInput(
                f"lexicon {path.stem!r} is damaged ({err}); save it again", field="lexicon"
            ) from err
        try:
            entries = make_entries(data.get("entries"), self.family)
        except InvalidInput as err:
            raise InvalidInput(
                f"lexicon {name!r} does not fit {self.family}: {err}", field="lexicon"
            ) from err
        return Lexicon(path.stem, name, entries, public, updated)


def _files(folder: Path) -> builtins.list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("*.json") if _ID.match(p.stem))
