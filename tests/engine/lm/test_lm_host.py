"""engine.lm.lm_host: vLLM's client in a host process, one Unix-socket connection per request. vLLM is not
installed here: the host builds a stand-in (tests/engine/lm/lm_host_stand_in.py) whose ids tell what reached
it; the process, the socket, the aborts, the failures and the leaving are the real ones."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import SamplingConfig
from engine.lm import lm_host
from engine.lm.backend import LMRequest
from engine.lm.bistream import Feed, Layout, Round, Table
from engine.lm.lm_config import SpeechLMConfig
from engine.lm.speech_lm import SpeechLM
from tests.engine.lm import lm_host_stand_in as stand_in

WAIT_S = 20.0
STOP = (6561, 6562, 6563)
FACTORY = f"{stand_in.__name__}:StandIn"


def spec(folder: Path) -> lm_host.HostSpec:
    return lm_host.HostSpec(folder, SamplingConfig(), 0.3, factory=FACTORY)


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Iterator[lm_host.HostedLM]:
    """One host for the tests that leave it serving (a spawned interpreter takes seconds to start)."""
    folder = tmp_path_factory.mktemp("host")
    backend = lm_host.HostedLM(spec(folder), dtype=torch.float32)
    yield backend
    backend.close()


def request(rid: str, rows: int = 3, seed: int = 0, max_len: int = 5) -> LMRequest:
    return LMRequest(rid, torch.ones(rows, 4), seed, 0, max_len, STOP)


async def ids(stream) -> list[int]:
    return [tok async for tok in stream]


async def arrives(path: Path) -> bool:
    """``wait_for`` with this event loop running (it closes the connections the test left)."""
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return path.exists()


def wait_for(path: Path) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.exists()


async def test_a_request_streams_the_hosts_ids_its_prompt_whole_and_its_stop_id_left_out(host):
    got = await ids(host.generate(request("whole", rows=3, max_len=5)))
    assert got == [3, 0, stand_in.FIRST_ID, stand_in.FIRST_ID + 1, stand_in.FIRST_ID + 2]
    assert host.active == 0 and host.healthy


async def test_closing_a_stream_early_aborts_the_request_in_the_host(host):
    """The server closes the request's connection (a listener left): the host closes the backend's stream,
    which is where VLLMBackend aborts the request in vLLM."""
    folder = host_folder(host)
    stream = host.generate(request("left", seed=stand_in.SLOW, max_len=400))
    first = [await anext(stream) for _ in range(3)]
    await stream.aclose()
    assert first == [3, 0, stand_in.FIRST_ID] and host.active == 0
    assert await arrives(folder / "aborted-left")
    assert await ids(host.generate(request("after", max_len=3))) == [3, 0, stand_in.FIRST_ID]


async def test_a_request_the_host_fails_raises_here_and_the_host_serves_on(host):
    with pytest.raises(lm_host.HostError, match=f"seed {stand_in.FAILS} is refused"):
        await ids(host.generate(request("refused", seed=stand_in.FAILS)))
    assert host.healthy and host.active == 0
    assert await ids(host.generate(request("next", rows=2, max_len=3))) == [2, 0, stand_in.FIRST_ID]


async def test_text_streaming_rounds_grow_one_prompt_and_carry_the_history_through_the_host(host):
    """The session runs here (``VLLMSession``, as with vLLM in this process): a round's prompt is all fed so
    far, its speech tokens fed back, and RAS's history travels with each round's request."""
    config = SpeechLMConfig(
        family="cosyvoice2", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
        intermediate_size=32, text_vocab_size=64,
    )  # fmt: skip
    host.lm = SpeechLM(config)
    session = host.session("bi", seed=0)
    first = [t async for t in session.round(Round((Feed(Table.TEXT, (1, 2, 3, 4)),), budget=3, final=False))]
    fill = Layout.of(config).fill_id  # the budget's 3 speech ids, then the fill the session forces
    assert first == [4, 0, stand_in.FIRST_ID, fill]
    second = [t async for t in session.round(Round((Feed(Table.TEXT, (5, 6)),), budget=3, final=False))]
    assert second == [4 + 3 + 2, 4, stand_in.FIRST_ID, fill]  # 4 rows, 3 speech ids fed back, 2 rows; 4 ids
    await session.aclose()


def host_folder(host: lm_host.HostedLM) -> Path:
    return host.spec.export


async def test_with_the_fork_server_the_host_forks_from_it_and_serves(tmp_path, monkeypatch):
    """EngineConfig.lm_fork_server: the host is a child of the fork server (vLLM imported there), not of
    this process, and answers the same."""
    from engine.lm import fork_server

    monkeypatch.setattr(fork_server, "_started_at", None)  # "started": this test alone (the server lives on)
    fork_server.start((stand_in.__name__,))
    backend = lm_host.HostedLM(spec(tmp_path), dtype=torch.float32)
    try:
        parent = int(Path(f"/proc/{backend.process.pid}/stat").read_text().split(")")[-1].split()[1])
        assert parent != os.getpid()
        assert await ids(backend.generate(request("forked", rows=5, max_len=3))) == [5, 0, stand_in.FIRST_ID]
    finally:
        backend.close()
    assert (tmp_path / "closed").exists()


def test_a_host_that_cannot_build_its_backend_fails_the_start_with_the_reason(tmp_path):
    with pytest.raises(lm_host.HostError, match=r"no model at .*missing"):
        lm_host.HostedLM(spec(tmp_path / "missing"))


async def test_a_host_whose_engine_died_leaves_and_its_backend_reads_unhealthy(tmp_path):
    backend = lm_host.HostedLM(spec(tmp_path), dtype=torch.float32)
    try:
        with pytest.raises(lm_host.HostError, match="engine core died"):
            await ids(backend.generate(request("dies", seed=stand_in.DIES)))
        backend.process.join(WAIT_S)
        assert backend.process.exitcode == 0 and not backend.healthy and (tmp_path / "closed").exists()
        with pytest.raises(lm_host.HostError, match="does not answer"):
            await ids(backend.generate(request("late")))
    finally:
        backend.close()


def test_close_shuts_the_backend_down_and_removes_the_socket(tmp_path):
    backend = lm_host.HostedLM(spec(tmp_path), dtype=torch.float32)
    assert backend.socket.exists()
    backend.close()
    assert backend.process.exitcode == 0 and (tmp_path / "closed").exists()
    assert not backend.socket.exists() and not backend.healthy


SERVER = """
import sys, time, torch
from pathlib import Path
from engine.config import SamplingConfig
from engine.lm import lm_host
spec = lm_host.HostSpec(Path(sys.argv[1]), SamplingConfig(), 0.3, factory=sys.argv[2])
backend = lm_host.HostedLM(spec, dtype=torch.float32)
print(backend.process.pid, flush=True)
time.sleep(120)
"""


def test_the_host_leaves_when_its_server_is_killed(tmp_path):
    """A server killed outright (no close): the host sees its pipe's end close and shuts its backend down."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tmp_path), FACTORY], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert server.stdout is not None
        pid = int(server.stdout.readline())
        server.send_signal(signal.SIGKILL)
        server.wait(WAIT_S)
        assert wait_for(tmp_path / "closed")
        deadline = time.monotonic() + WAIT_S
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.kill()


def alive(pid: int) -> bool:
    """Running (a zombie, ended and not yet reaped by init, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
