"""The API's side of the request contract: the engine's table of text checks (``engine.text.checks``)
applied to a route's own fields, before any work, with the route's parameter names in ``param``. The
speech route, the realtime socket and scripts call this one function, so a text refused at one door is
refused at every door, with the same code."""

from __future__ import annotations

from collections.abc import Mapping

from api.errors import ApiError, from_engine
from engine.errors import EngineError
from engine.text.checks import check_markup, check_text


def check_fields(
    fields: Mapping[str, str],
    max_chars: int,
    *,
    spoken: str | None = None,
    family: str | None = None,
    partial: bool = False,
) -> None:
    """Check each ``param -> text`` of ``fields``; ``spoken`` names the one read aloud (it also needs
    something to say, and only the supported markup when ``family`` is known). ``partial``: the spoken
    text is still arriving, so whether it says something is not known yet (its markup so far is)."""
    for param, text in fields.items():
        try:
            if param == spoken and partial:
                check_text(text, param, param, max_chars)
                if family:
                    check_markup(text, param, param, family)
            else:
                check_text(text, param, param, max_chars, spoken=param == spoken, family=family or None)
        except EngineError as err:
            raise from_engine(err) from err


def check_piece(text: str, param: str, max_chars: int) -> ApiError | None:
    """A piece of a text that arrives in pieces: its characters only (it may be a fragment of a word or a
    tag, so having something to say and markup are checked on the whole text)."""
    try:
        check_text(text, param, param, max_chars)
    except EngineError as err:
        return from_engine(err)
    return None
