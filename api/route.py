"""The API's route class: caps the request body before it is read and turns every failure into an
OpenAI-style JSON error, counting each response by route and status.

A route class (not app-wide exception handlers) keeps this behaviour to the API's own routes: the Gradio
UI mounted on the same app keeps its own error handling.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, NoReturn

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute
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
                    response = to_api_error(exc, request.headers.get("content-type", "")).response()
                telemetry.count(endpoint, response.status_code)
                return response

            return guarded

    return GuardedRoute


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def fallback_routes(served: Iterable[BaseRoute], telemetry: Telemetry) -> APIRouter:
    """Routes to include after every API route: each API path answers the methods it lacks with a 405
    (``Allow`` lists the ones it has), and any other ``/v1`` path with a 404, both as OpenAI errors.
    Without them the router's 404/405 is ``{"detail": ...}``, and with the UI mounted at "/" the mount
    answers every path the API does not fully match (a wrong method included) with its own 404."""
    allowed: dict[str, set[str]] = {}
    for route in served:
        if isinstance(route, APIRoute):
            allowed.setdefault(route.path, set()).update(route.methods or ())
    # the handlers never read the body, so no body is too large for them
    router = APIRouter(route_class=guarded_route(telemetry, sys.maxsize))
    for path, methods in allowed.items():
        others = [m for m in HTTP_METHODS if m not in methods]
        router.add_api_route(
            path,
            method_not_allowed(sorted(methods)),
            methods=others,
            include_in_schema=False,
            response_model=None,
        )
    router.add_api_route(
        "/v1/{rest:path}",
        unknown_route,
        methods=list(HTTP_METHODS),
        include_in_schema=False,
        response_model=None,
    )
    return router


def method_not_allowed(allowed: list[str]) -> Callable[[Request], Coroutine[Any, Any, NoReturn]]:
    allow = ", ".join(allowed)

    async def refuse(request: Request) -> NoReturn:
        message = f"{request.method} is not allowed on {request.url.path}; use {allow}"
        raise ApiError(405, message, code="method_not_allowed", headers={"Allow": allow})

    return refuse


async def unknown_route(request: Request) -> NoReturn:
    message = (
        f"no route {request.method} {request.url.path}; the API's routes are under /v1/audio and /v1/models"
    )
    raise ApiError(404, message, code="unknown_route")
