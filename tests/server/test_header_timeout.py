"""server/header_timeout.py: a client that opens a connection and never finishes its request head is
closed after the timeout; a client that sends its head in time is served as before."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from server.header_timeout import headers_timeout
from tests.conftest import WAIT_S


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def address() -> Iterator[tuple[str, int]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(hello, log_level="warning", lifespan="off", http=headers_timeout(0.3))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_a_head_that_never_ends_is_closed_after_the_timeout(address: tuple[str, int]) -> None:
    with socket.create_connection(address, timeout=WAIT_S) as conn:
        conn.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and nothing more
        started = time.monotonic()
        assert conn.recv(1024) == b""  # closed by the server, with nothing sent
    assert time.monotonic() - started < WAIT_S


def test_a_head_in_time_is_served(address: tuple[str, int]) -> None:
    with socket.create_connection(address, timeout=WAIT_S) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = conn.recv(1024)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok")
