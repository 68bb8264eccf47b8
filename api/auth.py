"""Optional bearer API keys: off unless ``--api-key`` (repeatable) or ``COSYSTREAM_API_KEY`` sets some.

Each key is its own voice namespace: ``caller`` (a FastAPI dependency) answers who is calling, and the
voice routes save, list and delete in that caller's namespace only. Without keys every API client is the
one anonymous caller ``ANONYMOUS`` (set keys to keep clients' voices apart).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Sequence

from fastapi import Request

from api.errors import ApiError

ENV_VAR = "COSYSTREAM_API_KEY"  # one key, or several separated by commas
ANONYMOUS = "api:anonymous"


def resolve_api_keys(explicit: str | Sequence[str] | None) -> tuple[str, ...]:
    """The keys to require: the explicit ones, else the environment's; empty means no key."""
    if explicit is None:
        explicit = os.environ.get(ENV_VAR, "").split(",")
    elif isinstance(explicit, str):
        explicit = [explicit]
    return tuple(dict.fromkeys(k.strip() for k in explicit if k.strip()))


def resolve_api_key(explicit: str | None) -> str | None:
    """The first key to require (the single-key form), None when there is none."""
    keys = resolve_api_keys(explicit)
    return keys[0] if keys else None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(token: str | None, key: str) -> bool:
    # compare_digest takes time independent of where the strings differ: no timing oracle on the key.
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


def matching_key(token: str | None, keys: Sequence[str]) -> str | None:
    """The key ``token`` equals, comparing with every key (the time does not tell which one matched)."""
    found = [key for key in keys if key_matches(token, key)]
    return found[0] if found else None


def owner_of(key: str | None) -> str:
    """The voice namespace of a caller; "api:" keeps API keys apart from the studio's browser ids."""
    return ANONYMOUS if key is None else f"api:key:{key}"


def require_key(keys: str | Sequence[str] | None) -> Callable[[Request], Awaitable[str]]:
    """A FastAPI dependency: lets every request through when there are no keys, else needs one of them as
    the bearer. It returns the caller's voice owner (``owner_of``)."""
    allowed = (keys,) if isinstance(keys, str) else tuple(keys or ())

    async def check(request: Request) -> str:
        if not allowed:
            return owner_of(None)
        token = bearer_token(request.headers.get("authorization"))
        key = matching_key(token, allowed)
        if key is None:
            message = "missing API key" if token is None else "invalid API key"
            headers = {"WWW-Authenticate": "Bearer"}
            raise ApiError(401, message, code="invalid_api_key", headers=headers)
        return owner_of(key)

    return check
