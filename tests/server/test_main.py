"""server.main: what the entry point sets up before the engine loads."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import types

import pytest
import uvicorn

import app
import server.main as entry
from engine.errors import ModelError
from engine.serving.startup import Timeline
from server import cli
from server.pending_engine import PendingEngine
from server.shutdown import EXIT_CONFIG, EXIT_UNHEALTHY, Gate, GracefulServer


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_logs_every_threads_stack(monkeypatch):
    """`kill -USR1 PID` logs the stacks (what a slow start or request waits for) and does not stop the
    server: ``prepare_process`` registers it (app.py runs it before the engine's configuration is read)."""
    registered: list[tuple[int, object]] = []
    monkeypatch.setattr(entry.signal, "signal", lambda sig, handler: registered.append((sig, handler)))
    entry.prepare_process()
    assert registered == [(signal.SIGUSR1, entry.log_stacks)]


def test_serve_refuses_replicas_it_cannot_start(monkeypatch):
    """The single-process server knows nothing of Ray: --replicas reaching it is the caller's mistake."""
    monkeypatch.setattr(entry, "engine_config", lambda args: pytest.fail("read the config"))
    with pytest.raises(ValueError, match="--replicas"):
        entry.serve(cli.parse_args(["--replicas", "2"]))


def test_the_stacks_name_each_thread_and_where_it_waits(caplog):
    release = threading.Event()

    def waiting_for_the_flow_compile() -> None:
        release.wait(30)

    worker = threading.Thread(target=waiting_for_the_flow_compile, name="graph-builder")
    worker.start()
    try:
        with caplog.at_level(logging.WARNING, "cosystream"):
            entry.log_stacks(signal.SIGINT, None)
    finally:
        release.set()
        worker.join()
    text = caplog.text
    assert "stack of thread graph-builder" in text and "waiting_for_the_flow_compile" in text
    assert "stack of thread MainThread" in text and "test_the_stacks_name_each_thread" in text


# ---------------------------------------------------------------------- configuration errors (issue 58)


def fail_if_started(*args, **kwargs):
    raise AssertionError("a configuration error must stop before the server starts")


@pytest.mark.parametrize("case", ["missing", "broken"])
def test_a_bad_model_dir_exits_with_the_config_status_and_one_line(monkeypatch, caplog, tmp_path, case):
    """Before: a traceback, a false "worker died; restarting" and status 3, which supervisors restart on."""
    model = tmp_path / "no" / "such" / "dir" if case == "missing" else tmp_path  # broken: no model files
    monkeypatch.setattr(entry, "web_server", fail_if_started)
    with caplog.at_level(logging.CRITICAL, "cosystream"), pytest.raises(SystemExit) as stop:
        app.main(["--model", str(model)])
    assert stop.value.code == EXIT_CONFIG == 78 and EXIT_CONFIG != EXIT_UNHEALTHY
    lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and lines[0].exc_info is None
    message = lines[0].getMessage()
    assert str(model) in message and "fix --model" in message and "restart" not in message


def test_replicas_without_ray_is_one_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.delitem(sys.modules, "cluster.application", raising=False)
    with caplog.at_level(logging.CRITICAL, "cosystream"), pytest.raises(SystemExit) as stop:
        app.main(["--model", "demo-tiny", "--replicas", "2"])
    assert stop.value.code == EXIT_CONFIG
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "--replicas needs Ray Serve" in line and "requirements-cluster.txt" in line


async def test_a_model_the_load_cannot_read_exits_with_the_config_status(caplog) -> None:
    """A hub id or a directory that breaks only while loading: the same status and one line."""

    def load() -> None:
        raise ModelError("model directory /models/x (cosyvoice3) is missing: flow.pt")

    engine = PendingEngine("/models/x", load, Timeline())
    with caplog.at_level(logging.INFO, "cosystream"):
        await engine.start()
        assert not engine.healthy and engine.config_error and "flow.pt" in engine.config_error

        async def app(scope, receive, send):
            raise AssertionError("no request is sent")

        gate = Gate(app)
        srv = GracefulServer(uvicorn.Config(gate), gate, engine, 1.0, "x")
        await asyncio.wait_for(srv.watch_health(every_s=0.01), 30)
    assert srv.should_exit and srv.exit_status == EXIT_CONFIG
    assert not any(r.exc_info for r in caplog.records) and "restarting" not in caplog.text
    assert "cannot start: model directory /models/x" in caplog.text


def test_the_web_apps_build_is_a_start_up_phase(monkeypatch):
    """The API's and the studio's routes are built before the engine's thread starts (their import brings
    torch in): a phase of the timeline, so /ready and the start-up profile account for those seconds."""
    seen: dict[str, object] = {}

    class Engine:  # PendingEngine's place: keeps the timeline the server hands it
        def __init__(self, model, build, timeline):
            seen["timeline"] = timeline

    class Server:
        exit_status = 0

        def run(self):
            timeline = seen["timeline"]
            assert isinstance(timeline, Timeline)
            seen["phases"] = [p.name for p in timeline.phases]

    monkeypatch.setattr(entry, "PendingEngine", Engine)
    monkeypatch.setattr(entry, "create_app", lambda engine, **kw: seen.setdefault("built", True))
    monkeypatch.setattr(entry, "web_server", lambda *a: Server())
    monkeypatch.setattr("server.shutdown.leave", lambda status: seen.setdefault("left", status))
    entry.serve(cli.parse_args(["--model", "demo-tiny"]))
    assert seen["built"] is True and seen["left"] == 0
    assert seen["phases"] == ["web app"]


@pytest.mark.parametrize(
    ("flags", "first"),
    [
        (["--backend", "vllm"], True),
        (["--backend", "native"], False),
        (["--backend", "vllm", "--no-lm-fork-server"], False),
        (["--device", "cpu"], False),  # auto on the CPU: the native loop serves
    ],
)
def test_the_fork_server_starts_before_the_web_apps_imports_where_vllm_will_serve(monkeypatch, flags, first):
    """vLLM's import (in the fork server's process) begins at launch, not once torch and the web app have
    loaded here (seconds on a GPU host), wherever vLLM is asked for."""
    from engine.lm import fork_server

    order: list[str] = []

    def start() -> None:
        order.append("fork server")
        fork_server._started_at = 0.0

    monkeypatch.setattr(fork_server, "_started_at", None)
    monkeypatch.setattr(fork_server, "start", start)
    monkeypatch.setattr(entry, "PendingEngine", lambda model, build, timeline: None)
    monkeypatch.setattr(entry, "create_app", lambda engine, **kw: order.append("web app"))
    monkeypatch.setattr(
        entry, "web_server", lambda *a: types.SimpleNamespace(run=lambda: None, exit_status=0)
    )
    monkeypatch.setattr("server.shutdown.leave", lambda status: None)
    entry.serve(cli.parse_args(["--model", "demo-tiny", *flags]))
    assert order == (["fork server", "web app"] if first else ["web app"])
