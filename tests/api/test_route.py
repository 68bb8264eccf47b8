"""api/route.py: paths and methods the API does not serve still get OpenAI-shaped errors: 404 for an
unknown ``/v1`` path, 405 with ``Allow`` for a known path asked with another method (also with the UI
mounted at "/", whose catch-all would otherwise answer with its own ``{"detail": ...}``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from api.app import build_api
from server import web
from tests.api.support import RecordingEngine, assert_openai_error, client_for


@pytest.fixture(scope="module")
def apps() -> dict[str, FastAPI]:
    """The API alone, and the whole app with the Gradio UI mounted at "/" (built once: it is slow)."""
    with_ui = web.create_app(RecordingEngine(), ui_lang="en", random_weights=True)
    return {"api": build_api(RecordingEngine(), api_key=""), "with_ui": with_ui}


@pytest.fixture(params=["api", "with_ui"])
async def client(request, apps: dict[str, FastAPI]) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(apps[request.param]) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/audio/speeches", "/v1/audio/voices/a/b"])
async def test_unknown_v1_paths_are_openai_404s(client: httpx.AsyncClient, path: str) -> None:
    for method in ("GET", "POST", "DELETE"):
        error = assert_openai_error(await client.request(method, path), 404)
        assert error["code"] == "unknown_route" and path in error["message"]


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("GET", "/v1/audio/speech", "POST"),
        ("PUT", "/v1/audio/voices", "GET, POST"),
        ("POST", "/v1/audio/voices/alice", "DELETE, GET"),
        ("DELETE", "/v1/models", "GET"),
        ("POST", "/health", "GET"),
        ("POST", "/metrics", "GET"),
    ],
)
async def test_a_wrong_method_is_an_openai_405(client: httpx.AsyncClient, method, path, allowed) -> None:
    r = await client.request(method, path)
    error = assert_openai_error(r, 405)
    assert error["code"] == "method_not_allowed" and r.headers["allow"] == allowed
    assert method in error["message"] and allowed in error["message"]


async def test_the_ui_still_owns_its_own_paths(apps: dict[str, FastAPI]) -> None:
    async with client_for(apps["with_ui"]) as c:
        assert (await c.get("/")).status_code == 200
        assert (await c.get("/not-an-api-path")).status_code == 404  # Gradio's answer, not the API's
