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
CUE_WORDS, CUE_SECONDS = 10, 4.0  # a subtitle cue holds up to this many words / this long


@dataclass(frozen=True)
class Word:
    text: str
    start_s: float
    end_s: float


class WordTimer(Protocol):
    """Recognised words with times, seconds from the start of ``pcm`` (the ASR's word timestamps)."""

    def words(self, pcm: np.ndarray, sample_rate: int, language: str | None) -> list[Word]: ...


def words_of(text: str) -> list[str]:
    """The words to time: whitespace-separated, tags removed; CJK characters one by one."""
    out: list[str] = []
    for token in _TAG.sub(" ", text).split():
        out += _cjk_split(token) if _CJK.search(token) else [token]
    return [w for w in out if any(c.isalnum() for c in w)]


def _cjk_split(token: str) -> list[str]:
    pieces: list[str] = []
    for char in token:
        if _CJK.match(char) or not pieces or _CJK.match(pieces[-1][-1]):
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


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str


def groups(words: Sequence[Word], max_words: int = CUE_WORDS, max_s: float = CUE_SECONDS) -> list[list[Word]]:
    """Words grouped for subtitle cues: a new group after ``max_words``, ``max_s`` or a sentence end."""
    out: list[list[Word]] = []
    group: list[Word] = []
    for word in words:
        if group and (len(group) >= max_words or word.end_s - group[0].start_s > max_s):
            out.append(group)
            group = []
        group.append(word)
        if word.text[-1] in ".?!。？！":
            out.append(group)
            group = []
    return [*out, group] if group else out


def cues(words: Sequence[Word]) -> list[Cue]:
    return [_cue(g) for g in groups(words)]


def _cue(words: Sequence[Word]) -> Cue:
    joiner = "" if all(_CJK.search(w.text) for w in words) else " "
    return Cue(words[0].start_s, words[-1].end_s, joiner.join(w.text for w in words))


def _clock(seconds: float, separator: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def to_srt(words: Sequence[Word]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, a blank line after each."""
    blocks = [
        f"{i}\n{_clock(c.start_s, ',')} --> {_clock(c.end_s, ',')}\n{c.text}\n"
        for i, c in enumerate(cues(words), 1)
    ]
    return "\n".join(blocks)


def to_vtt(words: Sequence[Word]) -> str:
    """WebVTT: the header, then cues with ``HH:MM:SS.mmm`` times; each word also timed inline
    (``<00:00:01.200>``) so players can highlight it."""
    blocks = ["WEBVTT\n"]
    for group in groups(words):
        c = _cue(group)
        inline = " ".join(
            w.text if k == 0 else f"<{_clock(w.start_s, '.')}>{w.text}" for k, w in enumerate(group)
        )
        blocks.append(f"{_clock(c.start_s, '.')} --> {_clock(c.end_s, '.')}\n{inline}\n")
    return "\n".join(blocks)
