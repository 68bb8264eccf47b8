"""server.main: what the entry point sets up before the engine loads."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

import server.main as entry


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_logs_every_threads_stack_from_the_first_second(monkeypatch):
    """`kill -USR1 PID` logs the stacks (what a slow start or request waits for) and does not stop the
    server: the handler is registered before the engine's configuration is even read."""
    registered: list[tuple[int, object]] = []
    monkeypatch.setattr(entry.signal, "signal", lambda sig, handler: registered.append((sig, handler)))

    def stop_here(args):
        raise SystemExit(0)

    monkeypatch.setattr(entry, "engine_config", stop_here)
    with pytest.raises(SystemExit):
        entry.main(["--model", "demo-tiny"])
    assert registered == [(signal.SIGUSR1, entry.log_stacks)]


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
