"""vLLM's client in a process of its own (``EngineConfig.lm_host``): the server's process never imports vLLM.

Why: AsyncLLM runs its client (vLLM's and transformers' imports, the engine arguments, each step's input and
output processing: Python) in the process that calls it, so in a warm start all of that ran on the server's
interpreter beside the weights and the first graphs. On an H100 the weights phase took 13.6-18.5 s inside a
warm start and 1.1-1.3 s alone (BENCHMARKS.md, "Start-up"). Here a host process builds the backend
(``engine.lm.vllm_backend.hosted``) and answers on a Unix socket; forked from the fork server where it runs
(``engine.lm.fork_server``), its imports are already done, and it forks vLLM's engine core in turn (it has no
CUDA context of its own).

One connection per request, which is all of the request's state here: the server sends an ``Ask`` (the
request and its sampling) and the prompt's embeddings [P, H] (CPU, vLLM's dtype, raw), the host streams the
ids vLLM emits and ends with DONE, or FAILED and the reason; the server closing the connection first aborts
the request in vLLM. ``generate`` and text-streaming sessions run in the server's process over ``tokens``
(``engine.lm.vllm_session``), as for the in-process backend. The host leaves when the server's end of its
pipe closes (the server exited, however) or when ``close`` asks; a host whose vLLM died exits, and the
backend reads unhealthy.

The mechanism is tested on the CPU with a stand-in backend in the host, and with vLLM on an H200 (the GPU
tests of ``tests/engine/lm/test_vllm_backend.py``, hosted; BENCHMARKS.md "Start-up", 4518c88); with
vllm-ascend, untested.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import multiprocessing
import os
import pickle
import shutil
import struct
import tempfile
import threading
from array import array
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from engine.config import SamplingConfig
from engine.lm import fork_server
from engine.lm.backend import LMRequest
from engine.lm.speech_lm import SpeechLM
from engine.lm.vllm_session import Sampling, VLLMSession, generate

log = logging.getLogger(__name__)
ASK, EMBEDS, TOKENS, DONE, FAILED = b"A", b"E", b"T", b"D", b"F"  # a frame's kind (1 byte), its length (4)
HEADER = struct.Struct("<cI")
CLOSE_S = 30.0  # a host asked to close has this long to shut vLLM down before it is killed


class HostError(RuntimeError):
    """The host failed to start, failed a request, or is gone."""


@dataclass(frozen=True)
class HostSpec:
    """What the host builds its backend from: ``VLLMBackend``'s arguments, and ``factory`` ("module:name",
    called with them in the host; tests name a stand-in)."""

    export: Path
    sampling: SamplingConfig
    gpu_memory_utilization: float
    profile_dir: str | None = None
    ras_graphs: bool = True
    kv_cache_gib: float | None = None
    factory: str = "engine.lm.vllm_backend:hosted"

    def __post_init__(self) -> None:
        if self.factory.count(":") != 1:
            raise ValueError(f"factory is 'module:name', got {self.factory!r}")


@dataclass(frozen=True)
class Ask:
    """One request to the host, but for its prompt embeddings, which follow in an EMBEDS frame as raw bytes
    (pickling a tensor goes through torch's serialiser: ~10 ms for a 200-row prompt on the VM)."""

    request: dict[str, Any]  # LMRequest's fields, but prefix
    sampling: Sampling
    shape: tuple[int, ...]  # the embeddings' [P, H]
    dtype: str  # torch's name of their dtype (vLLM's)

    @classmethod
    def of(cls, req: LMRequest, embeds: torch.Tensor, sampling: Sampling) -> tuple[Ask, bytes]:
        """(the ASK, the EMBEDS bytes) of a request and its embeddings (on the CPU)."""
        fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req) if f.name != "prefix"}
        flat = embeds.contiguous().view(torch.uint8)  # any dtype as its bytes (numpy has no bfloat16)
        ask = cls(fields, sampling, tuple(embeds.shape), str(embeds.dtype).removeprefix("torch."))
        return ask, flat.numpy().tobytes()

    def lm_request(self, embeds: bytes) -> LMRequest:
        dtype = getattr(torch, self.dtype)
        prefix = torch.frombuffer(bytearray(embeds), dtype=dtype).reshape(self.shape)
        return LMRequest(prefix=prefix, **self.request)


@dataclass(frozen=True)
class Ready:
    """The host's first message: its backend is up and its socket answers."""

    pid: int


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(kind, payload); IncompleteReadError where the other end closed first."""
    kind, size = HEADER.unpack(await reader.readexactly(HEADER.size))
    return kind, await reader.readexactly(size) if size else b""


class HostedLM:
    """The LM backend whose vLLM runs in a host process: ``NativeLM``'s and ``VLLMBackend``'s contract."""

    name = "vllm"

    def __init__(self, spec: HostSpec, dtype: torch.dtype = torch.bfloat16):
        """Start the host and wait (a process wait: this interpreter stays free) until its backend is up;
        HostError with the host's reason where it fails to start."""
        self.spec, self.dtype = spec, dtype
        self.lm: SpeechLM | None = None  # the engine sets it: sessions embed their rounds here
        self._folder = Path(tempfile.mkdtemp(prefix="cosystream-lm-"))  # short: a socket path is <= 107 bytes
        self.socket = self._folder / "lm.sock"
        self._active, self._closed = 0, False
        ctx: Any = fork_server.context() if fork_server.started() else multiprocessing.get_context("spawn")
        ready_r, ready_w = ctx.Pipe(duplex=False)
        stay_r, self._stay_w = ctx.Pipe(duplex=False)  # its EOF (or a message) tells the host to leave
        ends = (spec, self.socket, ready_w, stay_r)
        self.process = ctx.Process(target=host_main, args=ends, name="lm-host")
        self.process.start()
        ready_w.close()  # the host's ends are the host's alone: its ready pipe reads EOF if it dies
        stay_r.close()
        try:
            self._await_ready(ready_r)
        except BaseException:
            self.close()
            raise
        finally:
            ready_r.close()

    def _await_ready(self, ready: Connection) -> None:
        if ready not in wait([ready, self.process.sentinel]):
            raise HostError(f"the LM host exited while starting (exit {self.process.exitcode})")
        try:
            message = ready.recv()
        except EOFError as exc:
            self.process.join(CLOSE_S)
            raise HostError(f"the LM host exited while starting (exit {self.process.exitcode})") from exc
        if not isinstance(message, Ready):
            raise HostError(f"the LM host failed to start: {message}")
        log.info("the LM host (pid %d) serves vLLM at %s", message.pid, self.socket)

    @property
    def active(self) -> int:
        return self._active

    @property
    def healthy(self) -> bool:
        return not self._closed and self.process.is_alive()

    def params(self, req: LMRequest, sampling: Sampling | None = None) -> Sampling:
        return sampling or Sampling()  # the host makes vLLM's SamplingParams from it

    def generate(self, req: LMRequest) -> AsyncIterator[int]:
        return generate(self, req)

    def session(self, request_id: str, seed: int) -> VLLMSession:
        if self.lm is None:
            raise RuntimeError("text-streaming input needs the hosted backend's SpeechLM (set lm)")
        return VLLMSession(self, self.lm, request_id, seed)

    async def tokens(
        self, prompt: dict[str, Any], params: Sampling, req: LMRequest
    ) -> AsyncGenerator[int, None]:
        """Every id vLLM emits for the request, from the host; closed before its end, the host aborts it."""
        ask, embeds = Ask.of(req, prompt["prompt_embeds"], params)
        self._active += 1
        try:
            reader, writer = await asyncio.open_unix_connection(self.socket)
        except OSError as exc:
            self._active -= 1
            raise HostError(f"the LM host does not answer ({exc})") from exc
        try:
            writer.write(frame(ASK, pickle.dumps(ask)) + frame(EMBEDS, embeds))
            async for tok in _answers(reader):
                yield tok
        finally:
            self._active -= 1
            writer.close()  # before DONE: the host aborts the request

    def close(self) -> None:
        """Ask the host to shut vLLM down and leave; killed after ``CLOSE_S``."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._stay_w.send("close")
        self._stay_w.close()
        self.process.join(CLOSE_S)
        if self.process.is_alive():
            log.warning("the LM host did not leave in %.0f s: killed", CLOSE_S)
            self.process.kill()
            self.process.join()
        shutil.rmtree(self._folder, ignore_errors=True)


async def _answers(reader: asyncio.StreamReader) -> AsyncIterator[int]:
    """The ids of the host's TOKENS frames until DONE; HostError on FAILED or a host gone mid-request."""
    while True:
        try:
            kind, payload = await read_frame(reader)
        except asyncio.IncompleteReadError as exc:
            raise HostError("the LM host closed the request before its end (the host died?)") from exc
        if kind == DONE:
            return
        if kind != TOKENS:
            raise HostError(f"the LM host failed the request: {payload.decode(errors='replace')}")
        for tok in array("i", payload):
            yield tok


# --- the host process ---------------------------------------------------------------------------------------


def host_main(spec: HostSpec, socket: Path, ready: Connection, stay: Connection) -> None:
    """The host: build the backend, answer on ``socket`` until ``stay`` says close or its other end closes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        module, name = spec.factory.split(":")
        backend = getattr(importlib.import_module(module), name)(spec)
    except Exception as exc:  # the server logs the reason and serves on without vLLM (the handover)
        log.exception("the LM host could not build its backend")
        ready.send(f"{type(exc).__name__}: {exc}")
        return
    try:
        asyncio.run(_serve(backend, socket, ready, stay))
    finally:
        backend.close()


async def _serve(backend: Any, socket: Path, ready: Connection, stay: Connection) -> None:
    loop = asyncio.get_running_loop()
    leave = asyncio.Event()
    threading.Thread(target=_watch, args=(stay, loop, leave), name="lm-host-stay", daemon=True).start()
    server = await asyncio.start_unix_server(lambda r, w: _answer(backend, r, w, leave), path=str(socket))
    ready.send(Ready(os.getpid()))
    ready.close()
    async with server:
        await leave.wait()
    log.info("the LM host leaves")


def _watch(stay: Connection, loop: asyncio.AbstractEventLoop, leave: asyncio.Event) -> None:
    """Block on the server's pipe: a message (close) or its end closing (the server is gone) -> leave."""
    with contextlib.suppress(EOFError, OSError):
        stay.recv()
    loop.call_soon_threadsafe(leave.set)


async def _answer(
    backend: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, leave: asyncio.Event
) -> None:
    """One request: stream its ids; abort it in vLLM where the server closes the connection first."""
    try:
        req = await _request(reader)
        streaming = asyncio.ensure_future(_stream(backend, req, writer))
        gone = asyncio.ensure_future(reader.read(1))  # b"" once the server closes its end
        await asyncio.wait({streaming, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not streaming.done():
            streaming.cancel()  # closes the backend's stream: VLLMBackend.tokens aborts the request
        with contextlib.suppress(asyncio.CancelledError):
            await streaming
        if not backend.healthy:  # vLLM's engine core died: the server reads the host's exit as unhealthy
            log.error("the LM backend is unhealthy: the host leaves")
            leave.set()
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        log.info("a request's connection ended early (%s)", exc)
    finally:
        writer.close()


async def _request(reader: asyncio.StreamReader) -> tuple[LMRequest, Sampling]:
    """A connection's ASK and EMBEDS frames -> the request (its prefix the embeddings) and its sampling."""
    (kind, payload), (second, embeds) = await read_frame(reader), await read_frame(reader)
    if (kind, second) != (ASK, EMBEDS):
        raise ValueError(f"a request is an ASK frame and an EMBEDS frame, got {kind!r} and {second!r}")
    ask: Ask = pickle.loads(payload)
    return ask.lm_request(embeds), ask.sampling


async def _stream(backend: Any, request: tuple[LMRequest, Sampling], writer: asyncio.StreamWriter) -> None:
    req, sampling = request
    try:
        params = backend.params(req, sampling)
        async with contextlib.aclosing(backend.tokens({"prompt_embeds": req.prefix}, params, req)) as ids:
            async for tok in ids:
                writer.write(frame(TOKENS, array("i", [tok]).tobytes()))
        writer.write(frame(DONE))
    except Exception as exc:  # the request's failure is the server's to report; the host serves on
        log.warning("request %s failed: %s", req.request_id, exc)
        writer.write(frame(FAILED, f"{type(exc).__name__}: {exc}".encode()))
    await writer.drain()
