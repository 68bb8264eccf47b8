"""Optional bearer API key: off unless ``--api-key`` or ``COSYSTREAM_API_KEY`` sets one."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable

from fastapi import Request

from api.errors import ApiError

ENV_VAR = "COSYSTREAM_API_KEY"


def resolve_api_key(explicit: str | None) -> str | None:
    """The key to require: the explicit one, else the environment's; empty means no key."""
    key = explicit if explicit is not None else os.environ.get(ENV_VAR)
    return key or None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(token: str | None, key: str) -> bool:
    # compare_digest takes time independent of where the strings differ: no timing oracle on the key.
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


def require_key(key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that lets every request through when ``key`` is None, else needs the bearer."""

    async def check(request: Request) -> None:
        if key is None:
            return
        token = bearer_token(request.headers.get("authorization"))
        if not key_matches(token, key):
            message = "missing API key" if token is None else "invalid API key"
            headers = {"WWW-Authenticate": "Bearer"}
            raise ApiError(401, message, code="invalid_api_key", headers=headers)

    return check
