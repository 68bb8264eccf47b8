"""A streaming response that always closes its body generator, and tells the engine when the client left.

Starlette's ``StreamingResponse`` stops iterating when the client disconnects but leaves the generator
suspended (closed only whenever it is garbage-collected), so the engine would keep computing for nobody.
Here the body generator is closed in ``finally:`` (its own ``finally:`` closes the engine stream, whose
``finally:`` frees the request), and ``on_disconnect`` (``engine.abort``) runs first when the stream did
not complete. A body that fails after its headers raises ``StreamCut`` (``cut_stream``), and the server
cuts the connection: the client reads an incomplete body, where a clean end would pass the truncated
audio off as complete.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Mapping

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from engine.errors import EngineError, NotReady

log = logging.getLogger(__name__)


class StreamCut(Exception):
    """A streamed body ended early, its cause (``__cause__``) already logged by ``cut_stream``."""


def cut_stream(err: EngineError, what: str) -> StreamCut:
    """Log why ``what`` ended mid-stream, in one line as the SSE route does (an engine error's message says
    what went wrong; the engine logged its own faults where they happened), and return the ``StreamCut``
    to raise from ``err``."""
    if isinstance(err, NotReady):  # an end the server chose: shutting down, or the engine stopped
        log.warning("%s ended mid-stream: %s", what, err)
    else:
        log.warning("%s failed mid-stream: %s", what, err)
    return StreamCut(str(err))


class QuietCuts(logging.Filter):
    """For uvicorn's error logger: a response cut by ``StreamCut`` was logged once, by its route, so
    uvicorn's "Exception in ASGI application" trace of it is dropped (every other record passes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StreamCut))


QUIET_CUTS = QuietCuts()


class EngineStreamResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncGenerator[bytes | str, None],
        *,
        on_disconnect: Callable[[], None],
        on_start: Callable[[], None] = lambda: None,
        on_end: Callable[[], None] = lambda: None,
        media_type: str,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(content, media_type=media_type, headers=headers)
        self.generator = content
        self.on_disconnect, self.on_start, self.on_end = on_disconnect, on_start, on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed, aborted = False, False
        failure: Exception | None = None

        def abort_once() -> None:
            nonlocal aborted
            if not aborted:
                aborted = True
                log.info("client left a stream before its end; aborting the request")
                self.on_disconnect()

        async def send_marking_the_end(message: Message) -> None:
            # uvicorn answers the listener with http.disconnect as soon as the last body message is sent,
            # which can wake it before pump() below resumes: the stream is complete from that message on.
            nonlocal completed
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        self.on_start()
        try:
            async with anyio.create_task_group() as group:

                async def pump() -> None:
                    nonlocal completed, failure
                    try:
                        await self.stream_response(send_marking_the_end)
                        completed = True
                    except OSError:  # ASGI >= 2.4 servers raise it from send() once the client is gone
                        pass
                    except Exception as exc:  # re-raised below, outside the task group's ExceptionGroup
                        failure = exc
                    group.cancel_scope.cancel()

                group.start_soon(pump)
                await self.listen_for_disconnect(receive)  # returns on http.disconnect; cancelled at the end
                if not completed:
                    abort_once()  # before cancelling the pump, whose cancellation closes the engine stream
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):  # cleanup must run even when the server cancels us
                if not completed and failure is None:
                    abort_once()
                await self.generator.aclose()
                self.on_end()
        if failure is not None:
            raise failure
