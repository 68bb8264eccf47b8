"""The server's web app: one FastAPI app with the API, the studio's audio routes and the Gradio UI, and the
uvicorn server that runs it. Nothing heavy is imported at module level."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.config import Limits

if TYPE_CHECKING:
    from fastapi import FastAPI

    from server.shutdown import GracefulServer

log = logging.getLogger("cosystream")


def mount_api(app: FastAPI, engine: Any, limits: Limits, api_key: str | Sequence[str] | None) -> bool:
    """Add the OpenAI-style API (``api.app.mount_api``) when that package is present; before the UI mount."""
    try:
        from api.app import mount_api as mount
    except ModuleNotFoundError as err:
        if err.name not in ("api", "api.app"):
            raise
        log.warning("api/ is not available (%s): serving the UI only", err)
        return False
    mount(app, engine, limits, api_key)
    return True


def create_app(
    engine: Any,
    *,
    ui_lang: str = "auto",
    limits: Limits | None = None,
    api_key: str | Sequence[str] | None = None,
    random_weights: bool = False,
) -> FastAPI:
    """One FastAPI app: the API, the studio's PCM / download routes, then the Gradio UI at "/" (last,
    because a mount at "/" catches every path registered after it). With API keys the studio needs a
    Gradio login (any user name, a key as the password), so nobody uses it without a key."""
    import gradio as gr
    from fastapi import FastAPI

    from api.auth import resolve_api_keys
    from webui import stream_route
    from webui.layout import build_demo, page_options

    quiet_gradio_deprecations()
    limits = limits or Limits()
    hub, store = stream_route.StreamHub(), stream_route.AudioStore()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.ready:  # the engine serves only once warm; warm it on the server's event loop
            await engine.warmup()
        try:
            yield
        finally:
            store.cleanup()
            close = getattr(engine, "close", None)  # test fakes have nothing to release
            if close is not None:
                close()

    app = FastAPI(title="CosyStream", lifespan=lifespan)
    mount_api(app, engine, limits, api_key)
    app.include_router(stream_route.router(hub, store, open_timeout_s=limits.request_timeout_s))
    demo = build_demo(engine, ui_lang, limits, hub=hub, store=store, random_weights=random_weights)
    # uploads over the limit are refused before they are written to disk
    options = page_options(ui_lang) | {"max_file_size": limits.max_upload_bytes}
    keys = resolve_api_keys(api_key)
    if keys:
        options["auth"] = studio_login(keys)
    return gr.mount_gradio_app(app, demo, path="/", **options)


def quiet_gradio_deprecations() -> None:
    """Gradio 6's queue join reads ``starlette.status.HTTP_422_UNPROCESSABLE_ENTITY`` (renamed in Starlette)
    and calls pandas options pandas 3 deprecates: a warning per Generate click in the server log, about
    Gradio's own code, which nothing here can change. Only those messages from gradio's modules are muted."""
    for message in (
        r"'HTTP_422_UNPROCESSABLE_ENTITY' is deprecated",
        r"'future\.no_silent_downcasting' is deprecated",
        r"The copy keyword is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, module=r"gradio\.")


def studio_login(keys: Sequence[str]) -> Callable[[str, str], bool]:
    """Gradio's auth check: any user name with one of the API keys as the password."""
    from api.auth import matching_key

    def check(_username: str, password: str) -> bool:
        return matching_key(password, keys) is not None

    return check


def open_share_link(host: str, port: int) -> None:
    """A public *.gradio.live tunnel to this server (needs internet; failures are logged, not fatal)."""
    from gradio import networking

    def run() -> None:
        try:
            local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            url = networking.setup_tunnel(local, port, secrets.token_urlsafe(32), None, None)
            log.info("public share link: %s", url)
        except Exception as err:  # the tunnel is optional: the local server keeps running
            log.error("could not open a share link: %s", err)

    threading.Thread(target=run, name="share-tunnel", daemon=True).start()


def web_server(
    app: FastAPI, host: str, port: int, model: str, engine: Any = None, grace_s: float = 5.0
) -> GracefulServer:
    """uvicorn for ``app`` behind the shutdown gate (``server.shutdown``: SIGINT / SIGTERM drain for at most
    ``grace_s``, then ``engine.end_streams``). "CosyStream on http://..." is logged once the socket listens
    (port 0: the port the system picked), after the lifespan has warmed the engine, so the URL answers."""
    import uvicorn

    from server.shutdown import Gate, GracefulServer

    gate = Gate(app)
    return GracefulServer(
        uvicorn.Config(gate, host=host, port=port, log_level="info"), gate, engine, grace_s, model
    )
