"""The engine as the server holds it while it loads: the server listens from its first second (``/health``
answers, ``/ready`` says it is loading) and the engine is built on a thread behind it, then warmed.

``PendingEngine`` stands in for the ``TTSEngine`` (the API's ``EngineLike``): until the engine is loaded
and warm it is alive and not ready, and every use fails with ``NotReady`` (503 + Retry-After); from then on
each attribute is the engine's. A load that fails makes it unhealthy, so the server exits with the status
its supervisor restarts on (``server.shutdown.GracefulServer.watch_health``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.errors import ModelError, NotReady
from engine.serving.metrics import ServerStats
from engine.serving.startup import Timeline

log = logging.getLogger("cosystream")
LOADING = "the model is still loading"
RETRY_S = 5.0


class PendingEngine:
    """``load()`` (blocking: it builds the engine) runs on a thread once ``start`` is awaited."""

    sample_rate = 24000

    def __init__(self, model: str, load: Callable[[], Any], timeline: Timeline) -> None:
        self.startup = timeline  # the load's phases go on it too: /ready shows them once ready
        self._model, self._load = model, load
        self._loaded: Any = None  # the engine once built (maybe still warming up)
        self._engine: Any = None  # the engine once warm: every use goes to it
        self._failed = False
        self.config_error: str | None = None  # why the configured model cannot load (``ModelError``)
        self._built = asyncio.Event()  # set once the load has ended, built or failed

    async def start(self) -> None:
        """Build the engine off the event loop, then warm it on this loop; a failure is logged and leaves
        this engine unhealthy (the server then exits for its supervisor)."""
        try:
            try:
                self._loaded = await in_daemon_thread(self._load, "engine-load")
            finally:
                self._built.set()
            await self._loaded.warmup()
        except ModelError as err:  # the configuration's fault (the model dir): one line, its own exit status
            self._failed, self.config_error = True, str(err)
            return
        except Exception:
            self._failed = True
            log.exception("the engine could not be loaded")
            return
        self._engine = self._loaded

    @property
    def ready(self) -> bool:
        return self._engine is not None and bool(self._engine.ready)

    @property
    def healthy(self) -> bool:
        return not self._failed and (self._engine is None or bool(self._engine.healthy))

    async def built(self) -> bool:
        """Wait for the load's end -> whether the engine was built (it may be warming up still): what the
        model is (its name, family, presets, example voices) is known from then on."""
        await self._built.wait()
        return self._loaded is not None

    @property
    def model_name(self) -> str:
        return self._model if self._loaded is None else str(self._loaded.model_name)

    @property
    def family(self) -> str:
        return "" if self._loaded is None else str(self._loaded.family)

    def instruct_presets(self) -> Any:
        return self._model_facts().instruct_presets()

    def example_voices(self) -> Any:
        return self._model_facts().example_voices()

    @property
    def asr_model(self) -> str | None:
        return None if self._engine is None else self._engine.asr_model

    def stats(self) -> ServerStats:
        return ServerStats() if self._engine is None else self._engine.stats()

    async def stream(self, req: Any) -> AsyncIterator[Any]:
        """The engine's stream, closed with this one (a caller that leaves aborts its decode)."""
        async with contextlib.aclosing(self._served().stream(req)) as chunks:
            async for chunk in chunks:
                yield chunk

    def abort(self, request_id: str) -> bool:
        return self._engine is not None and bool(self._engine.abort(request_id))

    def end_streams(self, reason: str) -> int:
        return 0 if self._engine is None else int(self._engine.end_streams(reason))

    def close(self) -> None:
        """Close the engine if it was built (a load still running ends with the process)."""
        if self._loaded is not None:
            self._loaded.close()

    def __getattr__(self, name: str) -> Any:
        """Everything else (voices, transcription, the studio's calls) is the warm engine's."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._served(), name)

    def _model_facts(self) -> Any:
        """The built engine, for what does not need it warm (the studio's build reads it then)."""
        if self._loaded is None:
            raise NotReady(LOADING, retry_after_s=RETRY_S)
        return self._loaded

    def _served(self) -> Any:
        if self._engine is None:
            raise NotReady(LOADING, retry_after_s=RETRY_S)
        return self._engine


def in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """``fn()`` on a daemon thread of its own, awaitable: unlike the loop's executor (whose threads the
    loop's end joins), a server stopped meanwhile exits at once (an engine load or a Gradio build can take
    minutes on a loaded machine)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # cancelled: the server stopped meanwhile
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            result, error = fn(), None
        except Exception as err:
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done
