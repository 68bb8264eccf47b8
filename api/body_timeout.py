"""Request bodies read under a timeout: a client that declares a body and stops sending it (a
``Content-Length: 5000`` with 60 bytes sent) is answered 408 and its connection closed, instead of holding
it open for ever.

An ASGI middleware over the whole app (API and studio): each piece of a body must come within ``idle_s``
of the one before, and the whole body within ``total_s``. Once the body is complete, ``receive`` is the
server's own again (a streaming response listens on it for the client's disconnect for as long as it runs).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError

TOTAL_PER_IDLE = 30  # the whole body may take this many idle timeouts (a 20 MB upload on a slow link)


class BodyTimedOut(ApiError):
    def __init__(self, seconds: float):
        message = f"the request body did not arrive in time (nothing for {seconds:g} s); send it whole"
        super().__init__(408, message, code="body_timeout", headers={"Connection": "close"})


class BodyTimeout:
    def __init__(self, app: ASGIApp, idle_s: float):
        self.app, self.idle_s, self.total_s = app, idle_s, idle_s * TOTAL_PER_IDLE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_s
        complete, started = False, False

        async def timed_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            wait = max(0.0, min(self.idle_s, deadline - loop.time()))
            try:
                async with asyncio.timeout(wait):
                    message = await receive()
            except TimeoutError:
                raise BodyTimedOut(self.idle_s) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, watched_send)
        except BodyTimedOut as err:  # raised where nothing turned it into a response (not an API route)
            if started:
                raise
            await err.response()(scope, receive, send)
