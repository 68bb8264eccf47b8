"""Mount the API on the app that also serves the UI."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from api import lexicons, ops, realtime, script, speech, transcriptions, voices
from api.auth import resolve_api_keys
from api.body_timeout import BodyTimeout
from api.context import ApiContext, EngineLike
from api.route import fallback_routes
from api.telemetry import Telemetry
from engine.config import Limits


def mount_api(
    app: FastAPI,
    engine: EngineLike,
    limits: Limits | None = None,
    api_key: str | Sequence[str] | None = None,
) -> ApiContext:
    """Add every API route to ``app``. Call it before mounting the Gradio UI at "/", whose mount would
    otherwise catch these paths. ``api_key`` (one key or several, each its own voice namespace) None falls
    back to ``COSYSTREAM_API_KEY``; empty = no key."""
    ctx = ApiContext(engine, limits or Limits(), resolve_api_keys(api_key), Telemetry(engine))
    app.add_middleware(BodyTimeout, idle_s=ctx.limits.body_timeout_s)  # every route's body, the studio's too
    modules = (ops, speech, script, realtime, voices, lexicons, transcriptions)
    routers = [module.routes(ctx) for module in modules]
    for router in routers:
        app.include_router(router)
    app.include_router(fallback_routes((r for router in routers for r in router.routes), ctx.telemetry))
    app.state.cosystream_api = ctx
    return ctx


def build_api(
    engine: EngineLike, limits: Limits | None = None, api_key: str | Sequence[str] | None = None
) -> FastAPI:
    """A FastAPI app serving only the API (tests, headless deployments)."""
    app = FastAPI(title="CosyStream API")
    mount_api(app, engine, limits, api_key)
    return app
