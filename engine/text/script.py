"""Scripts: several speakers, inline pauses and the model's own tags, in one text.

Format, one turn per line::

    Alice: Hello Bob. <break time="500ms"/> How are you?
    Bob (whispering): I am fine [breath] thanks.
    and a line without a name continues the current speaker.

- ``Name:`` opens a turn when ``Name`` is one of the cast (the names mapped to voices; case does not
  matter). ``Name (instruct):`` gives that line an instruction (instruct mode) and must name a cast member.
  Any other ``Words:`` is ordinary text. Text before the first turn is spoken by the cast's first voice.
- ``<break time="500ms"/>`` (or ``"1.5s"``, SSML style) is exact silence at that place, up to
  ``MAX_BREAK_S``. Empty lines and lines starting with ``#`` are skipped.
- The model's tags (``[breath]``, ``[laughter]``, ``<strong>...</strong>`` ...: ``special_tokens.json``) pass
  through to the model; any other ``<...>`` or ``[...]`` is refused, so markup is never read out.

``compile_script`` turns a script into ``Part`` s: ``Speech`` (one engine request: a sentence or a few,
one speaker) and ``Pause`` (silence: a break, or the gap between two turns). Sentences are cut here so a
long text streams from its first sentence on and progress can count them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

from engine.errors import InvalidInput, TooLarge, shown
from engine.text.frontend import resolve_language, special_tokens
from engine.text.split import cut_sentences, is_punctuation_only, merge_sentences, terminals_for

MAX_BREAK_S = 10.0  # one break; longer silences are a sign of a typo ("5000s")
MAX_GAP_S = 5.0  # between turns
MAX_SCRIPT_CHARS = 20_000  # the whole script (each part stays far below the engine's max_text_chars)
# silence one text or script may ask for (breaks and gaps together), checked before any work: 1000 breaks
# of 10 s are 19 KB of text and would be 2.8 hours of audio
MAX_PAUSE_S = 300.0
# audio one script may produce (speech and silence), checked as it is produced
MAX_SCRIPT_AUDIO_S = 1800.0
PART_CHARS = 200  # sentences are merged into parts of up to about this many characters
_NAME = r"[^\W\d_][\w .'\-]{0,31}?"
_TURN = re.compile(rf"^(?P<name>{_NAME})\s*(?:\((?P<instruct>[^()]*)\))?\s*:\s*(?P<text>.*)$")
_BREAK = re.compile(r"<\s*break\b(?P<attrs>[^<>]*?)/?\s*>", re.IGNORECASE)
_BREAK_TIME = re.compile(r"""^\s*time\s*=\s*["']\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>ms|s)\s*["']\s*$""")
_TAG = re.compile(r"<[^<>]*>|\[[^\[\]]*\]")
# the model's sound and emphasis tags, what each does (the studio offers them as one-click inserts); v3
# also knows pronunciation tags: English phones ([AA1] ...) and pinyin ([j][ǐ] ...)
TAG_HELP = {
    "[breath]": "an audible breath",
    "[quick_breath]": "a short, quick breath",
    "[laughter]": "a burst of laughter",
    "<laughter>...</laughter>": "the words inside spoken while laughing",
    "<strong>...</strong>": "stress on the words inside",
    "[sigh]": "a sigh",
    "[cough]": "a cough",
    "[lipsmack]": "a lip smack",
    "[mn]": "a closed-mouth 'mm'",
    "[noise]": "a short noise",
}


@dataclass(frozen=True)
class Line:
    """One turn of the script: who speaks, how (instruct, may be empty), what; ``number`` is 1-based."""

    speaker: str
    text: str
    instruct: str = ""
    number: int = 1


@dataclass(frozen=True)
class Speech:
    """Text for one engine request, in one voice."""

    speaker: str
    text: str
    instruct: str = ""
    line: int = 1


@dataclass(frozen=True)
class Pause:
    """Exact silence of ``seconds`` (a break in a line, or the gap between turns)."""

    seconds: float
    line: int = 1


Part = Speech | Pause


def parse_script(script: str, cast: Sequence[str]) -> list[Line]:
    """The script's turns; ``cast`` is the speakers' names in order (the first speaks untitled text)."""
    if not cast:
        raise InvalidInput("a script needs at least one speaker mapped to a voice", field="voices")
    if len(script) > MAX_SCRIPT_CHARS:
        raise TooLarge(
            f"the script has {len(script)} characters; the limit is {MAX_SCRIPT_CHARS}", field="text"
        )
    names = {name.strip().casefold(): name for name in cast}
    lines: list[Line] = []
    speaker = cast[0]
    for number, raw in enumerate(script.splitlines(), 1):
        line = _line(raw.strip(), number, names, speaker)
        if line is not None:
            speaker = line.speaker
            lines.append(line)
    if not lines:
        raise InvalidInput("the script has no text to speak", field="text")
    return lines


def _line(raw: str, number: int, names: dict[str, str], speaker: str) -> Line | None:
    if not raw or raw.startswith("#"):
        return None
    match = _TURN.match(raw)
    if match is None:
        return Line(speaker, raw, "", number)
    name, instruct = match["name"].strip(), (match["instruct"] or "").strip()
    known = names.get(name.casefold())
    if known is None and match["instruct"] is None:
        return Line(speaker, raw, "", number)  # "Note: ..." is text unless Note is in the cast
    if known is None:
        cast = ", ".join(names.values())
        raise InvalidInput(f"line {number}: speaker {name!r} has no voice (the cast: {cast})", field="voices")
    if not match["text"].strip():
        raise InvalidInput(f"line {number}: {known} has nothing to say", field="text")
    return Line(known, match["text"].strip(), instruct, number)


def break_seconds(tag: str, line: int = 1) -> float:
    """Seconds of a ``<break time="..."/>`` tag (ms or s, at most ``MAX_BREAK_S``)."""
    match = _BREAK.fullmatch(tag.strip())
    timing = _BREAK_TIME.match(match["attrs"]) if match else None
    if timing is None:
        message = f'line {line}: {tag!r} is not a pause; write <break time="500ms"/> or "1.5s"'
        raise InvalidInput(message, field="text", code="invalid_break")
    seconds = float(timing["value"]) / (1000.0 if timing["unit"] == "ms" else 1.0)
    if seconds > MAX_BREAK_S:
        message = f"line {line}: a break of {seconds:g} s is over the limit of {MAX_BREAK_S:g} s"
        raise InvalidInput(message, field="text", code="break_too_long")
    return seconds


@cache
def model_tags(family: str) -> frozenset[str]:
    """The inline tags ``family``'s tokenizer knows, less the prompt-format markers (``<|...|>``)."""
    return frozenset(t for t in special_tokens(family) if not t.startswith("<|"))


@cache
def pronunciation_tokens(family: str) -> frozenset[str]:
    """The family's phone and pinyin tokens (``[N]``, ``[AY1]``, ``[j]``, ``[ǐ]``): the released list after
    ``<|endofsystem|>``; none for CosyVoice2, whose tokenizer has no such tokens."""
    tokens = special_tokens(family)
    marker = "<|endofsystem|>"
    return frozenset(tokens[tokens.index(marker) + 1 :]) if marker in tokens else frozenset()


def unsupported_tag(text: str, family: str) -> str | None:
    """The first ``<...>`` or ``[...]`` in ``text`` that is neither a break nor one of the model's tags."""
    allowed = model_tags(family)
    for match in _TAG.finditer(text):
        tag = match.group()
        if tag not in allowed and not _BREAK.fullmatch(tag):
            return tag
    return None


def check_tags(text: str, family: str, line: int = 1) -> None:
    """Refuse any ``<...>`` or ``[...]`` that is neither a break nor one of the model's tags."""
    tag = unsupported_tag(text, family)
    if tag is not None:
        known = ", ".join(TAG_HELP)
        pause = '<break time="500ms"/>'
        message = f"line {line}: unknown tag {shown(tag)}; pauses are {pause}, the model knows {known}"
        raise InvalidInput(message, field="text", code="unsupported_markup")


def cut_at_breaks(text: str) -> list[str | Pause]:
    """``text`` as its pieces (unstripped, as written) and the pauses of its breaks, empty pieces dropped:
    for text that arrives in pieces, where the spaces between pieces matter."""
    out: list[str | Pause] = []
    pos = 0
    for match in _BREAK.finditer(text):
        out += [text[pos : match.start()], Pause(break_seconds(match.group()))]
        pos = match.end()
    out.append(text[pos:])
    return [p for p in out if not isinstance(p, str) or p]


def has_break(text: str) -> bool:
    return _BREAK.search(text) is not None


def split_pauses(text: str, line: int = 1) -> list[str | Pause]:
    """``text`` cut at its breaks: the text pieces (stripped, empty ones dropped) and the pauses between."""
    out: list[str | Pause] = []
    pos = 0
    for match in _BREAK.finditer(text):
        out += [text[pos : match.start()].strip(), Pause(break_seconds(match.group(), line), line)]
        pos = match.end()
    out.append(text[pos:].strip())
    return [p for p in out if isinstance(p, Pause) or (p and not is_punctuation_only(p))]


def sentences(text: str, max_chars: int = PART_CHARS) -> list[str]:
    """``text`` in pieces of whole sentences, each up to about ``max_chars`` (a longer sentence stays
    whole): every character kept, in order."""
    cut = cut_sentences(text, terminals_for(resolve_language(text)))
    merged = merge_sentences(cut, len, max_chars, max_chars // 2, 0)
    return [s.strip() for s in merged if s.strip()]


def compile_script(lines: Iterable[Line], family: str, gap_s: float = 0.3) -> list[Part]:
    """The parts to render in order: speech per sentence group, a ``Pause`` per break and between turns."""
    if not 0.0 <= gap_s <= MAX_GAP_S:
        raise InvalidInput(
            f"gap between turns must be within [0, {MAX_GAP_S:g}] s, got {gap_s:g}", field="gap"
        )
    parts: list[Part] = []
    for line in lines:
        check_tags(line.text, family, line.number)
        if parts and gap_s > 0:
            parts.append(Pause(gap_s, line.number))
        for piece in split_pauses(line.text, line.number):
            if isinstance(piece, Pause):
                parts.append(piece)
                continue
            parts += [Speech(line.speaker, s, line.instruct, line.number) for s in sentences(piece)]
    if not any(isinstance(p, Speech) for p in parts):
        raise InvalidInput("the script has only pauses: nothing to speak", field="text")
    check_pauses(parts)
    return parts


def check_pauses(parts: Iterable[object]) -> None:
    """Refuse more silence than ``MAX_PAUSE_S`` in all (``TooLarge``, code ``too_much_silence``)."""
    total = sum(p.seconds for p in parts if isinstance(p, Pause))
    if total > MAX_PAUSE_S:
        message = f"the pauses add up to {total:g} s of silence; the limit is {MAX_PAUSE_S:g} s"
        raise TooLarge(message, field="text", code="too_much_silence")
