"""A connection's request head read under a timeout: uvicorn waits for ever on a client that connects and
never finishes its headers (its keep-alive timeout starts only after a first response), so such a client
holds a connection, and a few hundred hold the server's file descriptors. The request body has its own
timeout (``api.body_timeout``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("cosystream")
HEADERS_TIMEOUT_S = 10.0


def headers_timeout(seconds: float = HEADERS_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, else h11) closing a connection whose first request head has not
    arrived ``seconds`` after it opened (``uvicorn.Config(http=...)``)."""

    class HeadersTimeout(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.headers_timer = self.loop.call_later(seconds, self.headers_late)

        def headers_late(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request head so far
                log.info("closing a connection whose request head did not arrive within %g s", seconds)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self.headers_timer.cancel()
            super().connection_lost(exc)

    return HeadersTimeout
