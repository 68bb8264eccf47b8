"""The API's route class: caps the request body before it is read and turns every failure into an
OpenAI-style JSON error, counting each response by route and status.

A route class (not app-wide exception handlers) keeps this behaviour to the API's own routes: the Gradio
UI mounted on the same app keeps its own error handling.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import Message, Receive

from api.errors import ApiError, to_api_error
from api.telemetry import Telemetry


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body is over the limit of {max_bytes} bytes", code="body_too_large")


def check_content_length(request: Request, max_bytes: int) -> None:
    """Refuse a declared oversize body before reading a byte of it."""
    declared = request.headers.get("content-length")
    if declared is None:
        return
    if not declared.strip().isdigit():
        raise ApiError(400, f"bad Content-Length header {declared!r}", code="bad_content_length")
    if int(declared) > max_bytes:
        raise too_large(max_bytes)


def capped_receive(receive: Receive, max_bytes: int) -> Receive:
    """``receive`` that fails once more than ``max_bytes`` of body arrived (chunked uploads carry no
    Content-Length, and a client may lie in it)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise too_large(max_bytes)
        return message

    return wrapped


def guarded_route(telemetry: Telemetry, max_body_bytes: int) -> type[APIRoute]:
    """An ``APIRoute`` subclass bound to one API instance's metrics and one body cap."""

    class GuardedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            endpoint = self.path_format

            async def guarded(request: Request) -> Response:
                try:
                    check_content_length(request, max_body_bytes)
                    capped = Request(request.scope, capped_receive(request.receive, max_body_bytes))
                    response = await handler(capped)
                except Exception as exc:  # the API boundary: every failure becomes a JSON error
                    response = to_api_error(exc).response()
                telemetry.count(endpoint, response.status_code)
                return response

            return guarded

    return GuardedRoute
