"""The server's web app: one FastAPI app with the API, the studio's audio routes and the Gradio UI, and the
uvicorn server that runs it. Nothing heavy is imported at module level."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from engine.config import Limits
from engine.serving.startup import Timeline
from server.pending_engine import PendingEngine, in_daemon_thread

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
    studio_later: bool = False,
) -> FastAPI:
    """One FastAPI app: the API, the studio's PCM / download routes, then the Gradio UI at "/" (last,
    because a mount at "/" catches every path registered after it). With API keys the studio needs a
    Gradio login (any user name, a key as the password, ``webui.login``), so nobody uses it without a key;
    a session's saved voices are then its key's, the API's namespace for that key.

    ``studio_later``: the server answers (API, /health, /ready) as soon as the engine is warm, and the UI
    (importing Gradio alone takes ~10-25 s on a 2-core CPU) is built in a thread and mounted when done;
    until then "/" says the studio is loading (503, Retry-After). A ``PendingEngine`` is loaded behind a
    listening server (``/health`` answers from the start), the UI after it."""
    from fastapi import FastAPI

    from api.auth import owner_of, resolve_api_keys
    from webui import stream_route
    from webui.login import KeyLogin, TaggedLogin

    limits = limits or Limits()
    hub, store = stream_route.StreamHub(), stream_route.AudioStore()
    keys = resolve_api_keys(api_key)
    login = KeyLogin(keys, owner_of) if keys else None
    studio = StudioMount(engine, ui_lang, limits, login, random_weights, hub, store)

    async def start_later(later: contextlib.AsyncExitStack) -> None:
        if not isinstance(engine, PendingEngine):
            if studio_later:
                await studio.mount_later(app, later)
            return
        starting = asyncio.create_task(engine.start())
        later.callback(starting.cancel)  # the server's end stops a load still running
        # Where Gradio's import ran while the engine waited for vLLM, the studio is built during the
        # warm-up: built after ready, its 0.7-1.2 s of Python were the first request's extra TTFA on the
        # H200 (BENCHMARKS.md "Start-up"). Where it did not (a CPU load has no such wait), the import's
        # seconds would delay ready instead: the build waits for ready. A failed load builds nothing.
        early = studio_later and await engine.built() and studio_imported()
        if early:
            await studio.mount_later(app, later)
        await starting
        if studio_later and not early and engine.ready:
            await studio.mount_later(app, later)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # the engine serves only once warm: a built one is warmed on the server's event loop before the
        # server listens; a PendingEngine loads and warms behind a server that already answers /health
        # anyio's first thread call on this loop imports its asyncio backend (15 ms of a 2-core CPU): made
        # here, not by the first request's prompt decode
        import anyio.to_thread

        await anyio.to_thread.run_sync(int)
        if not isinstance(engine, PendingEngine) and not engine.ready:
            await engine.warmup()
        async with contextlib.AsyncExitStack() as later:
            task = asyncio.create_task(start_later(later))
            later.callback(task.cancel)
            try:
                yield
            finally:
                store.cleanup()
                close = getattr(engine, "close", None)  # test fakes have nothing to release
                if close is not None:
                    close()

    app = FastAPI(title="CosyStream", lifespan=lifespan)
    mount_api(app, engine, limits, api_key)
    app.state.stream_hub = hub  # web_server shuts it before it waits for open responses
    signed_in = login.signed_in if login else None

    def previews(voice_id: str, owner: str | None) -> Any:
        """The voice library's play buttons: looked up per call (a PendingEngine has it once loaded)."""
        preview = getattr(engine, "voice_preview", None)
        return preview(voice_id, owner) if preview is not None else None

    # with a login: a signed-in session's voice namespace (its key's), for the previews and the lab
    account = (lambda r: login.owner(login.session_user(r))) if login else None
    routes = stream_route.router(hub, store, limits.request_timeout_s, signed_in, previews, account)
    app.include_router(routes)
    api_ctx = getattr(app.state, "cosystream_api", None)
    if api_ctx is not None:  # the lab's takes are API requests in the browser's namespace
        from webui import lab_route

        app.include_router(lab_route.router(api_ctx, signed_in, account))
    if login is not None:  # a middleware joins before the app starts, so before a later mount too
        app.add_middleware(TaggedLogin, login=login)
    if studio_later:
        studio.placeholder(app)
        return app
    return studio.mount(app)


def import_studio() -> None:
    """Gradio's import (most of the studio's build, seconds of the interpreter), done ahead: the
    engine runs it while it waits for the LM backend's start (``TTSEngine.load``'s ``idle_work``), so the
    build after ready is short and the first requests do not share the interpreter with it for long. An
    import that fails here (another thread importing a shared module at that moment) is logged and left to
    the build, which imports again: it must not fail the engine's load."""
    try:
        import gradio  # noqa: F401

        import webui.layout  # noqa: F401
    except ImportError:
        log.warning("importing the studio ahead failed; its build imports it again", exc_info=True)


def studio_imported() -> bool:
    """Gradio and the studio's modules are imported already (``import_studio`` ran): a build is then
    about a second of Python, not the import's seconds more."""
    return "gradio" in sys.modules and "webui.layout" in sys.modules


class StudioMount:
    """The Gradio UI over the engine, mounted at "/" now (``mount``) or once built (``mount_later``)."""

    def __init__(
        self, engine: Any, ui_lang: str, limits: Limits, login: Any, random_weights: bool, hub: Any,
        store: Any,
    ) -> None:  # fmt: skip
        self.engine, self.ui_lang, self.limits, self.login = engine, ui_lang, limits, login
        self.random_weights, self.hub, self.store = random_weights, hub, store
        self._placeholder: Any = None

    def mount(self, app: FastAPI) -> FastAPI:
        import gradio as gr
        from starlette.routing import Mount

        from webui.layout import build_demo, page_options
        from webui.login import login_message

        quiet_gradio_deprecations()
        login = self.login
        demo = build_demo(
            self.engine, self.ui_lang, self.limits, hub=self.hub, store=self.store,
            random_weights=self.random_weights, account=login.owner if login else None,
        )  # fmt: skip
        # uploads over the limit are refused before they are written to disk
        options = page_options(self.ui_lang) | {"max_file_size": self.limits.max_upload_bytes}
        if login is not None:
            options |= {"auth": login.check, "auth_message": login_message(self.ui_lang)}
        if self._placeholder is not None:
            app.router.routes.remove(self._placeholder)
        gr.mount_gradio_app(app, demo, path="/", **options)
        if login is not None:
            login.bind(next(r.app for r in app.routes if isinstance(r, Mount) and hasattr(r.app, "tokens")))
        return app

    def placeholder(self, app: FastAPI) -> None:
        """ "/" until the studio is mounted: a page that says so and reloads itself."""
        from fastapi.responses import HTMLResponse

        def loading() -> HTMLResponse:
            page = '<meta http-equiv="refresh" content="3"><p>CosyStream: the studio is loading...</p>'
            return HTMLResponse(page, status_code=503, headers={"Retry-After": "3"})

        app.add_api_route("/", loading, methods=["GET"], include_in_schema=False)
        self._placeholder = app.router.routes[-1]

    async def mount_later(self, app: FastAPI, stack: contextlib.AsyncExitStack) -> None:
        """Build and mount the UI in a thread, then run Gradio's start-up as its own lifespan would
        (the server's has run already); its shutdown runs with ``stack``'s."""
        timeline = getattr(self.engine, "startup", None) or Timeline()
        try:
            with timeline.phase("studio UI", background=True):
                await in_daemon_thread(lambda: self.mount(app), "studio-build")
                gradio_app = app.router.routes[-1].app  # type: ignore[attr-defined]  # the mount just added
                await stack.enter_async_context(gradio_app.router.lifespan_context(gradio_app))
                gradio_app.get_blocks().run_startup_events()
                await gradio_app.get_blocks().run_extra_startup_events()
        except Exception:  # the API keeps serving; "/" keeps saying the studio is loading
            log.exception("the studio UI could not be built")
            raise
        log.info("the studio is up at /")


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

    from api.streaming import QUIET_CUTS
    from server.header_timeout import headers_timeout
    from server.shutdown import Gate, GracefulServer

    class Server(GracefulServer):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn waits for every open response before the lifespan ends: a live reader still waiting
            # for its request would hold the exit for the whole request timeout
            hub = getattr(app.state, "stream_hub", None)
            if hub is not None:
                hub.shutdown()
            await super().shutdown(sockets)

    from webui.stream_route import ALIVE_PATH

    gate = Gate(app, uncounted=(ALIVE_PATH,))
    # log_level configures uvicorn's loggers; a client must send its request head within 10 s
    config = uvicorn.Config(gate, host=host, port=port, log_level="info", http=headers_timeout())
    logging.getLogger("uvicorn.error").addFilter(QUIET_CUTS)  # a cut stream's trace: logged by its route
    return Server(config, gate, engine, grace_s, model)
