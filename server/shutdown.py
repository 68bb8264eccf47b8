"""Shutdown on SIGINT / SIGTERM: stop admitting at once, let streams in flight finish for a grace period,
then end them with an error, and exit within grace + 2 s; a second signal exits at once.

``Gate`` is ASGI middleware in front of the whole app: it counts the requests and sockets in flight and,
once closed, answers new requests 503 with ``Retry-After`` (OpenAI's error body) and new sockets one
``error`` event. ``GracefulServer`` is uvicorn with that signal handling: uvicorn's own waits for every
connection without bound, and its second Ctrl-C cancels tasks mid-flight (``CancelledError`` traces).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
from types import FrameType
from typing import Any, NoReturn

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("cosystream")
SHUTTING_DOWN = "the server is shutting down; retry in a moment (another replica may take the request)"
RETRY_AFTER_S = 5
EXIT_UNHEALTHY = 3  # the status a supervisor sees when the engine died under the server
# a configuration the server cannot start with (no such model directory, a broken one, a flag whose
# optional dependency is missing): sysexits' EX_CONFIG, which a supervisor must not restart on
EXIT_CONFIG = 78
HEALTH_EVERY_S = 1.0
STOPPED = "the speech engine has stopped (its LM backend or vocoder worker died); the server is restarting"
LAST_STEPS_S = 1.0  # after the grace: streams end within a chunk, then uvicorn closes and the engine frees


class Gate:
    """Requests in flight, and the door: open until ``close``; then every new request is refused."""

    def __init__(self, app: ASGIApp, uncounted: tuple[str, ...] = ()):
        self.app = app
        self.uncounted = uncounted  # sockets held open while idle (a page's line): no drain waits on them
        self.closed = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: the app's own start and stop
            await self.app(scope, receive, send)
            return
        if self.closed:
            await refuse(scope, receive, send)
            return
        if scope["type"] == "websocket" and scope["path"] in self.uncounted:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        self.idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()


def error_body() -> bytes:
    error = {
        "message": SHUTTING_DOWN,
        "type": "service_unavailable_error",
        "param": None,
        "code": "shutting_down",
    }
    return json.dumps({"error": error}).encode()


async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """503 + Retry-After for HTTP; a socket is accepted only to say why, then closed (1012: restarting)."""
    if scope["type"] == "http":
        headers = [(b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode())]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": error_body()})
        return
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps({"type": "error", **json.loads(error_body())})})
    await send({"type": "websocket.close", "code": 1012})


class GracefulServer(uvicorn.Server):
    """uvicorn whose SIGINT / SIGTERM drain through ``gate`` for at most ``grace_s``, then ask ``engine`` to
    end what is left (``end_streams``). "CosyStream on http://..." is logged once the socket listens."""

    def __init__(self, config: uvicorn.Config, gate: Gate, engine: Any, grace_s: float, model: str):
        super().__init__(config)
        self.gate, self.engine, self.grace_s, self.model = gate, engine, grace_s, model
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining: asyncio.Task[None] | None = None
        self.watching: asyncio.Task[None] | None = None
        self.exit_status = 0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self.watching = asyncio.create_task(self.watch_health())
        if self.started:
            for server in self.servers:
                for sock in server.sockets:
                    bound_host, bound_port = sock.getsockname()[:2]
                    log.info("CosyStream on http://%s:%d (model %s)", bound_host, bound_port, self.model)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the main thread between bytecodes: only flags and a callback onto the loop here."""
        if self.gate.closed or self.loop is None:  # a second signal, or one before the loop runs
            exit_now(sig)
        self.gate.closed = True
        self.loop.call_soon_threadsafe(self.start_drain, signal.Signals(sig).name)

    def start_drain(self, name: str) -> None:
        self.draining = asyncio.create_task(self.drain(name))

    async def drain(self, name: str) -> None:
        in_flight = self.gate.in_flight
        if in_flight:
            log.info(
                "%s: refusing new requests; %d in flight get up to %.1f s", name, in_flight, self.grace_s
            )
        try:
            async with asyncio.timeout(self.grace_s):
                await self.gate.idle.wait()
        except TimeoutError:
            ended = self.end_streams()
            log.warning(
                "shutdown grace of %.1f s is over: ending %d stream(s) with an error", self.grace_s, ended
            )
            try:
                async with asyncio.timeout(LAST_STEPS_S / 2):
                    await self.gate.idle.wait()
            except TimeoutError:
                log.warning("%d request(s) still open: closing their connections", self.gate.in_flight)
        self.config.timeout_graceful_shutdown = 1  # what is still open now is closed, not waited for
        self.should_exit = True

    def end_streams(self, reason: str = SHUTTING_DOWN) -> int:
        end = getattr(self.engine, "end_streams", None)  # test fakes may not have one
        return int(end(reason)) if end is not None else 0

    async def watch_health(self, every_s: float = HEALTH_EVERY_S) -> None:
        """Exit with ``EXIT_UNHEALTHY`` once the engine can no longer compute (vLLM's engine core or the
        native decode thread died, or the vocoder worker), for a supervisor to start a fresh process: a new
        process is the one recovery that also returns the device memory the dead worker held. Read on a
        timer: vLLM exposes its engine core's death only as a flag (``AsyncLLM.errored``)."""
        while getattr(self.engine, "healthy", True) and not self.should_exit:
            await asyncio.sleep(every_s)
        if self.should_exit:
            return
        config_error = getattr(self.engine, "config_error", None)
        if config_error:  # the model could not be loaded as configured: a restart would fail the same way
            log.critical("cannot start: %s (exiting with status %d)", config_error, EXIT_CONFIG)
            self.exit_status = EXIT_CONFIG
            self.config.timeout_graceful_shutdown = 1
            self.should_exit = True
            return
        self.gate.closed = True
        log.critical("%s: ending %d stream(s), exiting with status %d", STOPPED, self.end_streams(STOPPED),
                     EXIT_UNHEALTHY)  # fmt: skip
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LAST_STEPS_S):
                await self.gate.idle.wait()
        self.exit_status = EXIT_UNHEALTHY
        self.config.timeout_graceful_shutdown = 1
        self.should_exit = True


def exit_now(sig: int) -> NoReturn:
    """The second signal: leave at once, with the shell's status for a signal (128 + its number), no trace."""
    log.warning("%s again: exiting now", signal.Signals(sig).name)
    leave(128 + sig, wait_s=0.0)


def leave(status: int, wait_s: float = 1.0) -> NoReturn:
    """Exit with ``status``: child processes (the text pool's workers, an LM engine core) joined for up to
    ``wait_s`` then killed, logs flushed. The interpreter's own teardown is skipped: it walks the whole heap
    (torch and gradio loaded: millions of objects), seconds on a busy host, for memory the exit returns."""
    for child in multiprocessing.active_children():
        child.join(wait_s)
        if child.is_alive():
            child.kill()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
