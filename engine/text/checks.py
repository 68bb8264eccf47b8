"""The one table of checks every text goes through before any work, whichever door it came in by: the
HTTP routes, the realtime socket, scripts, the studio and the engine itself (``Planner.check``).

Each check has a ``code`` (the API's error code, the same at every door), the exception class that says
its status (``TooLarge`` 413, ``InvalidInput`` 422) and a message that names the field and the limit.
``spoken`` texts (what is said aloud) also need something to say and may only carry the markup the
project supports: ``<break time="..."/>`` and the model's own tags (``engine.text.script``); prompt
transcripts and instructions are checked for length, control characters and lone surrogates only.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidInput, TooLarge, shown

# Control characters a text may hold: line breaks and tabs are layout, every other Cc is not text.
LAYOUT = frozenset("\n\r\t")


def has_control(text: str) -> bool:
    return any(unicodedata.category(c) == "Cc" and c not in LAYOUT for c in text)


def has_surrogate(text: str) -> bool:
    return any(unicodedata.category(c) == "Cs" for c in text)


_MARKUP = re.compile(r"<[^<>]*>|\[[^\[\]]*\]")


def without_markup(text: str) -> str:
    return _MARKUP.sub(" ", text)


def speakable(text: str, family: str | None = None) -> bool:
    """Whether ``text`` has anything to say: a letter or a digit outside its tags, or (with ``family``) one of
    the family's pronunciation tokens (``[N][AY1]``: a lexicon's hint is speech). Emoji, symbols,
    punctuation, invisible format characters and combining marks alone are not speech."""
    if any(unicodedata.category(c)[0] in "LN" for c in without_markup(text)):
        return True
    if family is None:
        return False
    from engine.text.script import pronunciation_tokens  # the tokenizer's list, read once per family

    return any(tag in pronunciation_tokens(family) for tag in _MARKUP.findall(text))


@dataclass(frozen=True)
class Check:
    """One row of the table: ``fails(text)`` -> refuse with ``error(message, code)``."""

    code: str
    fails: Callable[[str, str | None], bool]  # (text, model family or None)
    message: str  # formatted with what= (e.g. "input")
    error: type[InvalidInput] = InvalidInput
    spoken_only: bool = False


TABLE = (
    Check(
        "invalid_unicode",
        lambda t, _: has_surrogate(t),
        "{what} is not valid Unicode (it has lone surrogate characters)",
    ),
    Check(
        "control_characters",
        lambda t, _: has_control(t),
        "{what} contains control characters (only \\n, \\r and \\t)",
    ),
    Check(
        "nothing_to_speak",
        lambda t, family: not speakable(t, family),
        "{what} has nothing to speak",
        spoken_only=True,
    ),
)


def check_text(
    text: str, what: str, field: str, max_chars: int, *, spoken: bool = False, family: str | None = None
) -> None:
    """Refuse ``text`` (called ``what`` in messages, ``field`` of the request) on the first failed check:
    over ``max_chars`` characters (``text_too_long``), then the table's rows, then (``spoken`` with a
    ``family``) markup the project does not support (``unsupported_markup``)."""
    if len(text) > max_chars:
        message = f"{what} has {len(text)} characters; the limit is {max_chars}"
        raise TooLarge(message, field=field, code="text_too_long")
    for check in TABLE:
        if (spoken or not check.spoken_only) and check.fails(text, family):
            raise check.error(check.message.format(what=what), field=field, code=check.code)
    if spoken and family:
        check_markup(text, what, field, family)


def check_markup(text: str, what: str, field: str, family: str) -> None:
    """Only ``<break time="..."/>`` and ``family``'s tags: anything else in ``<...>`` or ``[...]`` is refused
    by name (never read aloud)."""
    from engine.text.script import check_pauses, split_pauses, unsupported_tag  # the script format's

    try:  # each break's time, and all of them, within their limits
        check_pauses(split_pauses(text))
    except InvalidInput as err:  # a script's message names a line; this text is one field
        message = f"{what}: {str(err).removeprefix('line 1: ')}"
        raise type(err)(message, field=field, code=err.code) from None
    tag = unsupported_tag(text, family)
    if tag is not None:
        message = (
            f"{what} has markup this server does not support: {shown(tag)}; pauses are "
            '<break time="500ms"/> and the model\'s tags are [breath], [laughter], <strong>...</strong> ...'
        )
        raise InvalidInput(message, field=field, code="unsupported_markup")
