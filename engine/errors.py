"""Errors the engine raises on purpose; callers map them to UI messages or HTTP status codes."""

from __future__ import annotations


class EngineError(Exception):
    """Base class. ``str(err)`` is a message fit to show a user as is; ``field`` names the
    ``SynthesisRequest`` field at fault (``"voice_id"``, ``"language"`` ...) where there is one, so an API
    can name its own parameter; ``code`` the error's code in the API's vocabulary, where it has one."""

    status = 500

    def __init__(self, message: str = "", *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code  # the API's error code where the check has its own (``engine.text.checks``)


class InvalidInput(EngineError):
    """The caller's input is wrong (empty text, bad audio, unknown mode ...): HTTP 400/422."""

    status = 422


class Unspeakable(InvalidInput):
    """The text holds nothing to speak once normalised (only symbols, marks or invisible characters): the
    same request can never succeed, so a UI offers no retry."""


class TooLarge(InvalidInput):
    """An input is over a configured limit (text length, upload bytes, prompt seconds): HTTP 413."""

    status = 413


class NotFound(InvalidInput):
    """A named thing (saved voice, model) does not exist: HTTP 404."""

    status = 404


class Forbidden(InvalidInput):
    """The caller may not do this to that thing (delete a public or example voice): HTTP 403."""

    status = 403


class Conflict(InvalidInput):
    """The thing would clash with one that exists (a voice name the caller already sees): HTTP 409."""

    status = 409


class Busy(EngineError):
    """No capacity now; try again after ``retry_after_s``: HTTP 429 (queue full) or 503 (not ready)."""

    status = 429

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(Busy):
    status = 503


class Stopping(NotReady):
    """The server is going away (shut down, or restarting after its engine stopped) and ended this stream:
    not a busy server, and nothing another request to this process can fix."""


class ModelError(EngineError):
    """The model directory is missing files, has unexpected keys, or cannot be downloaded."""

    status = 500


class SynthesisFailed(EngineError):
    """The computation went wrong for this request (non-finite audio, device OOM); the engine stays usable."""

    status = 500


SHOWN_CHARS = 40  # how much of the caller's input a message quotes


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters: messages quote input, never without a bound."""
    if len(value) <= limit:
        return repr(value)
    return repr(value[:limit]) + f"... ({len(value)} characters)"
