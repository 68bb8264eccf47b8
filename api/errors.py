"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Every failure a route can meet (engine errors, validation errors, HTTP errors, bugs) becomes one
``ApiError``; the body never carries a stack trace (bugs are logged server-side with theirs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.errors import Busy, EngineError, Forbidden, InvalidInput, NotFound, NotReady, TooLarge

log = logging.getLogger(__name__)

# OpenAI's error "type" per status; anything else 4xx is an invalid request, 5xx a server error.
ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


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
        super().__init__(status_code=status, detail=message, headers=headers)
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
        return ApiError(413, message, param=param, code="too_large")
    if isinstance(err, Forbidden):
        return ApiError(403, message, param=param, code="forbidden")
    if isinstance(err, NotFound):  # one code per missing thing, whichever route asked for it
        code = "voice_not_found" if err.field == "voice_id" else "not_found"
        return ApiError(404, message, param=param, code=code)
    if isinstance(err, InvalidInput):
        return ApiError(422, message, param=param, code="invalid_input")
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
    message = first.get("msg", "invalid value")
    return ApiError(422, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def to_api_error(exc: Exception) -> ApiError:
    """Whatever a route raised, as an ``ApiError``; unexpected exceptions are logged with their traceback."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine(exc)
    if isinstance(exc, RequestValidationError):
        return from_validation(exc)
    if isinstance(exc, HTTPException):
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    log.exception("unhandled error in an API route", exc_info=exc)
    return ApiError(500, "internal server error (see the server log)", code="internal_error")
