"""Word timings for speech whose text is known, and subtitles (SRT, WebVTT) made of them.

Each spoken part of a script has a known text and a known span of the output (its first and last sample).
Two ways to place the words inside that span:

- ``align_words``: the server's Whisper transcribes the part with word timestamps; the known words are
  matched to the recognised ones (``difflib`` on normalised spellings) and take their times; words Whisper
  missed are spread over the gap between their matched neighbours. The text shown is always the known text.
- ``spread_words``: no ASR, or nothing matched: the words share the voiced stretch of the span (leading and
  trailing silence trimmed) in proportion to their letters (+1 each for the gap after a word). Speech rate
  is roughly constant in letters within one sentence, so this lands within a word or two.

Chinese-script text (no spaces) is timed per character. Times are seconds from the start of the output.
"""

from __future__ import annotations

import difflib
import logging
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

_TAG = re.compile(r"<[^<>]*>|\[[^\[\]]*\]")  # tags and breaks are not words
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
SILENCE_RATIO = 0.05  # a sample counts as voiced above this share of the part's peak
CUE_SECONDS = 7.0  # a subtitle cue is on screen at most this long


@dataclass(frozen=True)
class Word:
    text: str
    start_s: float
    end_s: float


class WordTimer(Protocol):
    """Recognised words with times, seconds from the start of ``pcm`` (the ASR's word timestamps)."""

    def words(self, pcm: np.ndarray, sample_rate: int, language: str | None) -> list[Word]: ...


def words_of(text: str) -> list[str]:
    """The words to time: whitespace-separated, tags removed; CJK characters one by one (with the
    punctuation after them)."""
    out: list[str] = []
    for token in _TAG.sub(" ", text).split():
        out += _cjk_split(token) if _CJK.search(token) else [token]
    return [w for w in out if any(c.isalnum() for c in w)]


def _cjk_split(token: str) -> list[str]:
    """A CJK character is a word; punctuation stays with the word before it (a cue ends at "。")."""
    pieces: list[str] = []
    for char in token:
        if pieces and not char.isalnum() and not _CJK.match(char):
            pieces[-1] += char
        elif _CJK.match(char) or not pieces or not pieces[-1][-1].isalnum() or _CJK.match(pieces[-1][-1]):
            pieces.append(char)
        else:
            pieces[-1] += char
    return pieces


def voiced_span(pcm: np.ndarray, sample_rate: int) -> tuple[float, float]:
    """Seconds of the first and last sample above ``SILENCE_RATIO`` of the peak; (0, 0) if silent."""
    level = np.abs(pcm)
    peak = float(level.max()) if level.size else 0.0
    if peak <= 0.0:
        return 0.0, 0.0
    loud = np.flatnonzero(level > SILENCE_RATIO * peak)
    return float(loud[0]) / sample_rate, float(loud[-1] + 1) / sample_rate


def spread(words: Sequence[str], start_s: float, end_s: float) -> list[Word]:
    """``words`` over [start_s, end_s] in proportion to their letters (+1 each)."""
    weights = np.array([sum(c.isalnum() for c in w) + 1 for w in words], float)
    if not len(words):
        return []
    edges = start_s + (end_s - start_s) * np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum()
    return [Word(w, float(a), float(b)) for w, a, b in zip(words, edges[:-1], edges[1:], strict=True)]


def spread_words(text: str, pcm: np.ndarray, sample_rate: int, offset_s: float = 0.0) -> list[Word]:
    """The fallback: ``text``'s words over the voiced part of ``pcm`` (which starts at ``offset_s``)."""
    start, end = voiced_span(pcm, sample_rate)
    return shift(spread(words_of(text), start, end), offset_s)


def shift(words: Sequence[Word], offset_s: float) -> list[Word]:
    return [replace(w, start_s=w.start_s + offset_s, end_s=w.end_s + offset_s) for w in words]


def _key(word: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKC", word).casefold() if c.isalnum())


def align(known: Sequence[str], heard: Sequence[Word], start_s: float, end_s: float) -> list[Word]:
    """Known words timed by the recognised ones they match; the rest spread between matched neighbours."""
    matcher = difflib.SequenceMatcher(None, [_key(w) for w in known], [_key(w.text) for w in heard], False)
    times: list[tuple[float, float] | None] = [None] * len(known)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            h = heard[block.b + k]
            times[block.a + k] = (h.start_s, h.end_s)
    out: list[Word] = []
    i = 0
    while i < len(known):
        if (t := times[i]) is not None:
            out.append(Word(known[i], *t))
            i += 1
            continue
        j = next((k for k in range(i, len(known)) if times[k] is not None), len(known))
        gap_start = out[-1].end_s if out else start_s
        nxt = times[j] if j < len(known) else None
        out += spread(known[i:j], gap_start, nxt[0] if nxt is not None else max(end_s, gap_start))
        i = j
    return out


def align_words(
    text: str, pcm: np.ndarray, sample_rate: int, timer: WordTimer | None, offset_s: float = 0.0,
    language: str | None = None,
) -> list[Word]:  # fmt: skip
    """``text``'s words timed in ``pcm`` (starting at ``offset_s`` of the output): by the ASR when there
    is one and it matched anything, else spread over the voiced stretch."""
    known = words_of(text)
    start, end = voiced_span(pcm, sample_rate)
    heard = timer.words(pcm, sample_rate, language) if timer is not None and known and end > start else []
    matched = heard and any(_key(w.text) in {_key(k) for k in known} for w in heard)
    words = align(known, heard, start, end) if matched else spread(known, start, end)
    return shift(words, offset_s)


# ------------------------------------------------------------------------------------------ subtitles
# A cue is one sentence, or a clause of a sentence too long for one cue; it never ends mid-clause unless a
# clause alone is too long, and then it is cut where its two halves last about as long as each other (the
# old word-count cut left 0.37 s tails of a sentence). Limits after common subtitle guides: two lines of
# about 42 characters (16 for Chinese script), at most 7 s on screen.
CUE_CHARS, CUE_CJK_CHARS = 84, 32
SENTENCE_END = tuple(".?!。？！…")
CLAUSE_END = tuple(",;:，；：、—")
CLOSERS = "\"'”’)）」』】"
SHORT_CUE_S = 1.2  # a sentence this short shares its cue with the next one of its speaker, where it fits


@dataclass(frozen=True)
class Turn:
    """One speaker's timed words, e.g. a spoken part of a script; ``speaker`` "" names nobody."""

    speaker: str
    words: tuple[Word, ...]


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str
    speaker: str = ""
    words: tuple[Word, ...] = ()


def _ends(word: Word, marks: tuple[str, ...]) -> bool:
    return word.text.rstrip(CLOSERS).endswith(marks)


def _joined(words: Sequence[Word]) -> str:
    joiner = "" if all(_CJK.search(w.text) for w in words) else " "
    return joiner.join(w.text for w in words)


def _fits(words: Sequence[Word], max_chars: int | None, max_s: float) -> bool:
    text = _joined(words)
    limit = max_chars if max_chars is not None else (CUE_CJK_CHARS if _CJK.search(text) else CUE_CHARS)
    return len(text) <= limit and words[-1].end_s - words[0].start_s <= max_s


def _runs(words: Sequence[Word], marks: tuple[str, ...]) -> list[list[Word]]:
    """``words`` cut after each word that ends with one of ``marks``."""
    out: list[list[Word]] = [[]]
    for word in words:
        out[-1].append(word)
        if _ends(word, marks):
            out.append([])
    return [run for run in out if run]


def _split(words: list[Word], max_chars: int | None, max_s: float) -> list[list[Word]]:
    """A sentence as cues: whole if it fits; else cut at the clause end (or, with none, the word gap)
    that leaves the two sides closest in duration, and each side the same way."""
    if len(words) < 2 or _fits(words, max_chars, max_s):
        return [words]
    clause_cuts = [i for i in range(1, len(words)) if _ends(words[i - 1], CLAUSE_END)]
    cuts = clause_cuts or list(range(1, len(words)))
    middle = (words[0].start_s + words[-1].end_s) / 2
    cut = min(cuts, key=lambda i: abs(words[i - 1].end_s - middle))
    return _split(words[:cut], max_chars, max_s) + _split(words[cut:], max_chars, max_s)


def _merge_short(groups: list[list[Word]], max_chars: int | None, max_s: float) -> list[list[Word]]:
    """A very short sentence ("Hi.") joins the next one where the two fit one cue."""
    out: list[list[Word]] = []
    for group in groups:
        last = out[-1] if out else None
        if last and last[-1].end_s - last[0].start_s < SHORT_CUE_S and _fits(last + group, max_chars, max_s):
            out[-1] = last + group
        else:
            out.append(group)
    return out


def _turns(said: Sequence[Word] | Sequence[Turn]) -> list[Turn]:
    if all(isinstance(x, Word) for x in said):
        return [Turn("", tuple(said))] if said else []  # type: ignore[arg-type]
    return [x for x in said if isinstance(x, Turn)]


def cues(
    said: Sequence[Word] | Sequence[Turn], max_chars: int | None = None, max_s: float = CUE_SECONDS
) -> list[Cue]:
    """Subtitle cues of timed words (one unnamed speaker) or of speakers' turns: a cue never spans two
    turns, and each holds a sentence, short sentences joined, long ones cut at clauses (``_split``).
    ``max_chars`` None: 84 characters, 32 for Chinese script."""
    out: list[Cue] = []
    for turn in _turns(said):
        sentences = [
            piece
            for sentence in _runs(turn.words, SENTENCE_END)
            for piece in _split(sentence, max_chars, max_s)
        ]
        for group in _merge_short(sentences, max_chars, max_s):
            out.append(Cue(group[0].start_s, group[-1].end_s, _joined(group), turn.speaker, tuple(group)))
    return out


def _clock(seconds: float, separator: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def to_srt(said: Sequence[Word] | Sequence[Turn]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, a blank line after each; a named
    speaker's cue starts "Name: "."""
    blocks = [
        f"{i}\n{_clock(c.start_s, ',')} --> {_clock(c.end_s, ',')}\n"
        f"{c.speaker + ': ' if c.speaker else ''}{c.text}\n"
        for i, c in enumerate(cues(said), 1)
    ]
    return "\n".join(blocks)


def _vtt_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_vtt(said: Sequence[Word] | Sequence[Turn]) -> str:
    """WebVTT: the header, then cues with ``HH:MM:SS.mmm`` times; a named speaker's cue is a voice span
    (``<v Name>``), and each word after the first is timed inline (``<00:00:01.200>``) so players can
    highlight it."""
    blocks = ["WEBVTT\n"]
    for c in cues(said):
        joiner = "" if all(_CJK.search(w.text) for w in c.words) else " "
        inline = joiner.join(
            _vtt_escape(w.text) if k == 0 else f"<{_clock(w.start_s, '.')}>{_vtt_escape(w.text)}"
            for k, w in enumerate(c.words)
        )
        voice = f"<v {_vtt_escape(c.speaker)}>" if c.speaker else ""
        blocks.append(f"{_clock(c.start_s, '.')} --> {_clock(c.end_s, '.')}\n{voice}{inline}\n")
    return "\n".join(blocks)
