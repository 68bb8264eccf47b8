"""SIGINT / SIGTERM on a real server process (``app.py`` on demo-tiny, CPU): new requests refused at once
(503 + Retry-After), streams in flight ended once the grace is over (a socket's with an error event, an
HTTP body cut short) without a trace in the log, the exit within grace + 2 s, a second signal exiting at
once without a trace, the port free and no child process left."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import soundfile as sf
import uvicorn
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from server.shutdown import EXIT_UNHEALTHY, Gate, GracefulServer
from tests.sounds import speech_like

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 2.0
START_CEILING_S = 600  # a loaded CI machine builds and warms demo-tiny in about a minute
# exits are bounded by design (grace + 2 s, idle at once); the margins absorb a loaded 2-core machine
EXIT_MARGIN_S = 6.0
IDLE_EXIT_S = 6.0


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    lines: list[str] = field(default_factory=list)
    listening: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "CosyStream on http://" in line:
                self.listening.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal_and_wait(self, sig: int, ceiling_s: float = 60) -> tuple[int, float]:
        """Send ``sig``; the exit status and the seconds the process took to exit."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        return self.proc.wait(ceiling_s), time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    """A new server could listen on it (as uvicorn binds: SO_REUSEADDR, so clients' TIME_WAIT is no hold)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in found.stdout.split()]


@contextmanager
def server(tmp_path: Path, grace_s: float = GRACE_S) -> Iterator[Server]:
    port = free_port()
    argv = [sys.executable, str(ROOT / "app.py"), "--model", "demo-tiny", "--device", "cpu", "--backend",
            "native", "--port", str(port), "--shutdown-grace-s", str(grace_s)]  # fmt: skip
    env = os.environ | {"HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    srv = Server(proc, port)
    threading.Thread(target=srv.read, daemon=True).start()
    try:
        assert srv.listening.wait(START_CEILING_S), "".join(srv.lines[-30:])
        assert until_ready(srv, time.monotonic() + START_CEILING_S), "".join(srv.lines[-30:])
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def until_ready(srv: Server, deadline: float) -> bool:
    """The server listens from its start and loads the engine behind it: wait until /ready says 200."""
    while time.monotonic() < deadline and srv.proc.poll() is None:
        try:
            if httpx.get(srv.url + "/ready", timeout=10).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def open_stream(url: str) -> ClientConnection:
    """A realtime stream that cannot finish by itself: text comes, the commit never does."""
    buf = io.BytesIO()
    sf.write(buf, speech_like(2.0), 24000, format="WAV", subtype="PCM_16")
    ws = connect(url.replace("http://", "ws://") + "/v1/audio/speech/realtime", open_timeout=60)
    session = {"mode": "cross_lingual", "ref_audio": base64.b64encode(buf.getvalue()).decode(), "seed": 1}
    ws.send(json.dumps({"type": "session.update", "session": session}))
    assert json.loads(ws.recv(timeout=120))["type"] == "session.updated"
    ws.send(json.dumps({"type": "input_text_buffer.append", "text": "Hello there, this is a stream"}))
    assert json.loads(ws.recv(timeout=120))["type"] == "response.audio.delta"
    return ws


def last_events(ws: ClientConnection) -> list[dict]:
    got = []
    try:
        while True:
            got.append(json.loads(ws.recv(timeout=60)))
    except (ConnectionClosed, TimeoutError):  # closed (or silent): what came before is the answer
        return got


def test_an_idle_server_exits_at_once_and_frees_everything(tmp_path: Path) -> None:
    """Idle: nothing to drain, so the exit is seconds (it was 6-12 s, and a pending studio read held it for
    minutes); the ceiling leaves room for a loaded machine, far below any timeout that could hold it."""
    with server(tmp_path) as srv:
        deadline = time.monotonic() + START_CEILING_S  # idle means the studio UI is built too
        while not any("the studio is up" in line for line in srv.lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        kids = children(srv.proc.pid)
        status, took = srv.signal_and_wait(signal.SIGTERM)
    assert status == 0 and took < IDLE_EXIT_S, (took, "".join(srv.lines[-10:]))
    assert port_is_free(srv.port) and not any(Path(f"/proc/{k}").exists() for k in kids)
    assert "Traceback" not in "".join(srv.lines)


@dataclass
class HttpStream:
    """A long ``/v1/audio/speech`` stream read in a thread: its bytes, and how it ended."""

    url: str
    started: threading.Event = field(default_factory=threading.Event)
    got: int = 0
    ended: Exception | None = None

    def read(self) -> None:
        speech = {"input": "This is a rather long text. " * 60, "voice": "en-amy", "response_format": "pcm"}
        try:
            with httpx.stream("POST", self.url + "/v1/audio/speech", json=speech, timeout=120) as r:
                for data in r.iter_bytes():
                    self.got += len(data)
                    self.started.set()
        except httpx.TransportError as err:
            self.ended = err
        self.started.set()


def test_a_stream_in_flight_gets_the_grace_then_an_error_and_new_requests_get_503(tmp_path: Path) -> None:
    with server(tmp_path) as srv:
        stream = HttpStream(srv.url)
        reader = threading.Thread(target=stream.read, daemon=True)
        reader.start()
        assert stream.started.wait(120) and stream.got > 0, stream.ended
        ws = open_stream(srv.url)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        refused = None
        while time.monotonic() - t0 < GRACE_S and srv.proc.poll() is None:  # while it drains
            try:
                refused = httpx.get(srv.url + "/health", timeout=5)
                break
            except httpx.TransportError:  # the signal is not handled yet
                continue
        events = last_events(ws)
        ws.close()
        status = srv.proc.wait(60)
        took = time.monotonic() - t0
        reader.join(60)
    assert isinstance(stream.ended, httpx.RemoteProtocolError), stream.ended  # cut: never a clean end
    assert refused is not None and refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["code"] == "shutting_down"
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["not_ready"] and "shutting down" in errors[0]["message"]
    assert status == 0 and GRACE_S <= took < GRACE_S + EXIT_MARGIN_S, took
    assert port_is_free(srv.port) and "Traceback" not in "".join(srv.lines)


def test_a_second_signal_exits_at_once_without_a_trace(tmp_path: Path) -> None:
    """A grace of a minute: an exit within seconds is the second signal's doing, not the grace ending."""
    with server(tmp_path, grace_s=60.0) as srv:
        ws = open_stream(srv.url)
        srv.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while not any("refusing new requests" in line for line in srv.lines) and time.monotonic() < deadline:
            time.sleep(0.05)  # the first signal is handled (its log line) before the second is sent
        status, took = srv.signal_and_wait(signal.SIGINT)
        ws.close()
    assert status == 128 + signal.SIGINT and took < IDLE_EXIT_S, took
    log = "".join(srv.lines)
    assert "Traceback" not in log and "CancelledError" not in log and "SIGINT again: exiting now" in log
    assert port_is_free(srv.port)


class DyingEngine:
    """Healthy until the test says otherwise; records why its streams were ended."""

    def __init__(self) -> None:
        self.healthy = True
        self.ended: list[str] = []

    def end_streams(self, reason: str) -> int:
        self.ended.append(reason)
        return 1


async def test_a_dead_engine_makes_the_server_exit_non_zero_for_its_supervisor() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("no request is sent")

    engine, gate = DyingEngine(), Gate(app)
    srv = GracefulServer(uvicorn.Config(gate), gate, engine, GRACE_S, "fake")
    watch = asyncio.create_task(srv.watch_health(every_s=0.01))
    await asyncio.sleep(0.05)
    assert not watch.done() and not srv.should_exit  # healthy: it keeps serving
    engine.healthy = False
    await asyncio.wait_for(watch, 30)
    assert srv.should_exit and srv.exit_status == EXIT_UNHEALTHY == 3 and gate.closed
    assert engine.ended and "stopped" in engine.ended[0]


async def test_a_pages_idle_line_is_no_request_in_flight() -> None:
    """A studio page holds ``/webui/alive`` open while idle: a drain must not wait on it (it would wait
    the whole grace on every shutdown with a page open), while any other socket counts."""
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()

    gate = Gate(app, uncounted=("/webui/alive",))
    line = asyncio.create_task(gate({"type": "websocket", "path": "/webui/alive"}, None, None))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert gate.in_flight == 0 and gate.idle.is_set()
    work = asyncio.create_task(gate({"type": "websocket", "path": "/v1/realtime"}, None, None))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert gate.in_flight == 1 and not gate.idle.is_set()
    release.set()
    await asyncio.wait_for(asyncio.gather(line, work), 30)
    assert gate.in_flight == 0 and gate.idle.is_set()
