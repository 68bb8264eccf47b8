"""server.main: what the entry point sets up before the engine loads."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

import server.main as entry
from server import cli


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
