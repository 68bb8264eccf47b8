"""engine.lm.fork_server on the CPU: a process of its context is forked from the fork server with the
preloaded module already imported there (not in the child, not in this process), and gets this process's
environment as it is at ``start()``, variables set after the server started included (the cache root's,
CUDA MPS's: a spawned engine core would read them). vLLM's use of it is checked by the start-up bench."""

from __future__ import annotations

import os
import sys

import pytest

from engine.lm import fork_server
from tests.engine.lm import fork_probe

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX: the fork server")
PROBE = fork_probe.__name__


def test_a_core_process_forks_from_the_preloaded_server_with_this_processs_environment(monkeypatch):
    monkeypatch.delenv("COSYSTREAM_FORK_PROBE", raising=False)
    monkeypatch.setattr(fork_server, "_started_at", None)  # "started": this test alone (the server lives on)
    fork_server.start((PROBE,))
    assert fork_server.started()
    monkeypatch.setenv("COSYSTREAM_FORK_PROBE", "set after the server started")
    ctx = fork_server.context()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=fork_probe.report, args=(send, "COSYSTREAM_FORK_PROBE"))
    proc.start()
    send.close()
    assert receive.poll(60), "the child sent nothing"
    imported_in, child, parent, value = receive.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert value == "set after the server started"
    # the child's copy of the module was imported in the fork server (its parent), before the fork
    assert imported_in == parent != os.getpid() == fork_probe.IMPORTED_IN
    assert child not in (parent, os.getpid())
    assert os.environ["COSYSTREAM_FORK_PROBE"] == "set after the server started"


def test_start_runs_once_a_process(monkeypatch):
    """Started at launch (server.main) and asked again by the engine's load: the second call does nothing."""
    monkeypatch.setattr(fork_server, "_started_at", 12.5)  # as if started at launch
    forkserver = fork_server.multiprocessing.forkserver
    monkeypatch.setattr(forkserver, "ensure_running", lambda: pytest.fail("started again"))
    fork_server.start((PROBE,))
    assert fork_server._started_at == 12.5
