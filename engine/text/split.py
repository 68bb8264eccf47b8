"""Sentence splitting of normalised text into LLM-sized segments (reference ``split_paragraph``).

Rules (cosyvoice/utils/frontend_utils.py, spec 3.6): cut after each terminal mark; a closing quote right
after the mark stays with the sentence; then merge sentences greedily, closing a segment only when adding the
next sentence would pass ``max_n`` AND the segment already holds more than ``min_n``; a last segment shorter
than ``merge_len`` joins the previous one. Length is characters for Chinese-script text and text tokens for
English. Two deliberate differences from the reference: a run of marks ("Wow!!", "真的？！") stays whole
(the reference drops all but the first, and crashes on a mark that opens the text followed by a quote), and
segments are stripped, with empty and punctuation-only ones dropped.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

ZH_TERMINALS = frozenset("。？！；：、.?!;")
EN_TERMINALS = frozenset(".?!;:")
CLOSING_QUOTES = frozenset('"”')


def terminals_for(lang: str) -> frozenset[str]:
    """English uses ASCII marks; every other language (zh, ja, ko, yue) the CJK set, which includes ASCII."""
    return EN_TERMINALS if lang == "en" else ZH_TERMINALS


def is_punctuation_only(text: str) -> bool:
    """True for text made only of Unicode punctuation (P*) and symbols (S*), or empty.

    The reference's ``^[\\p{P}\\p{S}]*$`` without the ``regex`` module."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


def cut_sentences(text: str, terminals: frozenset[str]) -> list[str]:
    """Cut ``text`` after each run of terminal marks (plus a following closing quote); keeps every char."""
    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        ends_run = c in terminals and (i + 1 == len(text) or text[i + 1] not in terminals)
        if not ends_run:
            continue
        end = i + 2 if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES else i + 1
        sentences.append(text[start:end])
        start = end
    if start < len(text):
        sentences.append(text[start:])
    return sentences


# A "sentence" longer than this (characters) is cut before merging: text without marks (2000 Chinese
# characters, a pasted list) would otherwise be one LM segment whose speech is minutes long, past what one
# flow pass takes. Cut at the last comma or space before the bound, or at the bound.
MAX_SENTENCE_CHARS = 200
SOFT_BREAKS = frozenset("，,、 \t\u3000")


def cut_long(sentence: str, max_chars: int = MAX_SENTENCE_CHARS) -> list[str]:
    """``sentence`` in pieces of at most ``max_chars`` characters, every character kept in order."""
    pieces: list[str] = []
    while len(sentence) > max_chars:
        soft = max((i for i in range(max_chars // 2, max_chars) if sentence[i] in SOFT_BREAKS), default=None)
        end = soft + 1 if soft is not None else max_chars
        pieces.append(sentence[:end])
        sentence = sentence[end:]
    return [*pieces, sentence] if sentence else pieces


def merge_sentences(
    sentences: list[str], length: Callable[[str], int], max_n: int, min_n: int, merge_len: int
) -> list[str]:
    """Greedy merge of consecutive sentences into segments (the reference's rule, see the module doc)."""
    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > max_n and length(current) > min_n:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < merge_len:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def split_sentences(
    text: str,
    lang: str,
    token_len_fn: Callable[[str], int] | None = None,
    max_n: int = 80,
    min_n: int = 60,
    merge_len: int = 20,
) -> list[str]:
    """Split normalised ``text`` into segments of about ``min_n``..``max_n`` length units.

    ``lang`` "en" measures length with ``token_len_fn`` (text tokens; required) and cuts at ``.?!;:``; any
    other language measures characters and cuts at ``。？！；：、.?!;``. A final mark is added when the text
    has none ("。" or "."), as the reference does.
    """
    text = text.strip()
    if not text:
        return []
    if lang == "en" and token_len_fn is None:
        raise ValueError("split_sentences(lang='en') needs token_len_fn (length in text tokens)")
    terminals = terminals_for(lang)
    if text[-1] not in terminals:
        text += "." if lang == "en" else "。"
    length = token_len_fn if lang == "en" and token_len_fn is not None else len
    sentences = [piece for sentence in cut_sentences(text, terminals) for piece in cut_long(sentence)]
    segments = merge_sentences(sentences, length, max_n, min_n, merge_len)
    return [s for s in (seg.strip() for seg in segments) if not is_punctuation_only(s)]
