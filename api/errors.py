"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Every failure a route can meet (engine errors, validation errors, HTTP errors, bugs) becomes one
``ApiError``; the body never carries a stack trace (bugs are logged server-side with theirs). ``code`` is
never null (an error raised without one gets its status's code) and ``param`` names the request field at
fault wherever there is one, for JSON fields and form fields alike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.errors import Busy, Conflict, EngineError, Forbidden, InvalidInput, NotFound, NotReady, TooLarge

log = logging.getLogger(__name__)

# OpenAI's error "type" per status; anything else 4xx is an invalid request, 5xx a server error.
ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
# The code of an error raised without one, by status.
STATUS_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    422: "invalid_value",
    429: "rate_limited",
    499: "client_closed",
    501: "not_implemented",
    503: "unavailable",
}
# FastAPI's one message for a body it could not decode (JSON that is not UTF-8, a malformed form).
UNPARSABLE_BODY = "There was an error parsing the body"
# An error message quotes the caller's input at most this long (a 100,000-character ``model`` must not
# come back as a 100 KB error body): the message is cut here, whatever quoted it.
MAX_MESSAGE_CHARS = 600


class ApiError(HTTPException):
    """An HTTP error with OpenAI's fields. Subclasses ``HTTPException`` so FastAPI's body parsing re-raises
    it untouched (it wraps any other exception raised while reading the body into a generic 400)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 30] + f"... ({len(message)} characters cut)"
        super().__init__(status_code=status, detail=message, headers=headers)
        code = code or STATUS_CODES.get(status, "invalid_request" if status < 500 else "internal_error")
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict[str, Any]:
        status = self.status_code
        kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def retry_after(seconds: float) -> dict[str, str]:
    """``Retry-After`` takes whole seconds; round up so a client never retries too early."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def from_engine(err: EngineError, params: Mapping[str, str] | None = None) -> ApiError:
    """Map the engine's error classes (most specific first: NotReady is a Busy, TooLarge an InvalidInput).
    ``params``: the route's parameter name for each request field (the field's own name otherwise)."""
    message = str(err) or type(err).__name__
    param = (params or {}).get(err.field, err.field) if err.field else None
    if isinstance(err, NotReady):
        return ApiError(503, message, code="not_ready", headers=retry_after(err.retry_after_s))
    if isinstance(err, Busy):
        return ApiError(429, message, code="queue_full", headers=retry_after(err.retry_after_s))
    if isinstance(err, TooLarge):
        return ApiError(413, message, param=param, code=err.code or "too_large")
    if isinstance(err, Forbidden):
        return ApiError(403, message, param=param, code="forbidden")
    if isinstance(err, Conflict):
        return ApiError(409, message, param=param, code="name_taken" if err.field == "name" else "conflict")
    if isinstance(err, NotFound):  # one code per missing thing, whichever route asked for it
        code = "voice_not_found" if err.field == "voice_id" else "not_found"
        return ApiError(404, message, param=param, code=code)
    if isinstance(err, InvalidInput):
        return ApiError(422, message, param=param, code=err.code or "invalid_input")
    # SynthesisFailed, ModelError: the engine's message is written to be shown as is.
    return ApiError(500, message, code=type(err).__name__.lower())


def from_validation(err: RequestValidationError) -> ApiError:
    """Report the first problem, naming the field; unparsable JSON is a 400, a bad field a 422."""
    problems = list(err.errors())
    if not problems:
        return ApiError(422, "invalid request", code="invalid_request")
    first = problems[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return ApiError(400, "the request body must be a JSON object", code="invalid_json")
    message = first.get("msg", "invalid value")
    return ApiError(422, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def unparsable_body(content_type: str) -> ApiError:
    if "json" in content_type:
        return ApiError(400, "the request body is not valid JSON (UTF-8 text)", code="invalid_json")
    return ApiError(400, "the request body could not be parsed as a form", code="invalid_form")


def to_api_error(exc: Exception, content_type: str = "") -> ApiError:
    """Whatever a route raised, as an ``ApiError``; unexpected exceptions are logged with their traceback.
    ``content_type``: the request's, to name what could not be parsed."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine(exc)
    if isinstance(exc, RequestValidationError):
        return from_validation(exc)
    if isinstance(exc, HTTPException) and exc.status_code == 400 and exc.detail == UNPARSABLE_BODY:
        return unparsable_body(content_type.lower())
    if isinstance(exc, HTTPException):
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    log.exception("unhandled error in an API route", exc_info=exc)
    return ApiError(500, "internal server error (see the server log)", code="internal_error")
