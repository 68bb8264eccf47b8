"""server.main: what the entry point sets up before the engine loads."""

from __future__ import annotations

import signal

import pytest

import server.main as entry


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_writes_every_threads_stack_from_the_first_second(monkeypatch):
    """`kill -USR1 PID` dumps the stacks (what a slow start or request waits for) and does not stop the
    server: the handler is registered before the engine's configuration is even read."""
    registered: list[tuple[int, bool]] = []

    def register(sig: int, all_threads: bool) -> None:
        registered.append((sig, all_threads))

    monkeypatch.setattr(entry.faulthandler, "register", register)

    def stop_here(args):
        raise SystemExit(0)

    monkeypatch.setattr(entry, "engine_config", stop_here)
    with pytest.raises(SystemExit):
        entry.main(["--model", "demo-tiny"])
    assert registered == [(signal.SIGUSR1, True)]
