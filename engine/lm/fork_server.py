"""A process that vLLM's engine core forks from, started at the engine's load with vLLM already imported.

vLLM 0.26 starts its engine core by fork or spawn. Fork is out: this process initialises CUDA (the weights,
the first graphs) while vLLM starts. Spawn runs a fresh interpreter that imports torch, transformers and
vLLM again before the core's own start: ~20 s of a warm start on the H200 (BENCHMARKS.md, "Start-up"),
after the same imports in this process. With ``lm_fork_server`` the load starts Python's fork server first
thing, preloading ``engine.lm.vllm_backend`` (vLLM's engine core with it) in a process of its own beside
this one's start; vLLM's engine core is then forked from that server, its imports done, its CUDA untouched.

A forked child has the fork server's environment, the one of this process when the server started; the
load sets variables after that (the cache root's compile caches, CUDA MPS's pipe), which a spawned core
reads. ``CoreProcess`` carries this process's environment as it is at ``start()`` into the child, as spawn
would. Only vllm_backend hands the context to vLLM. On an H100 (v3 warm, BENCHMARKS.md "Start-up") the core
forked 21.7 s after the server started and vLLM was up 44.3 s after launch (63.7 s spawned); the mechanism
itself is tested on the CPU. Untested with vllm-ascend.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import time
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext, ForkServerProcess

log = logging.getLogger(__name__)

# imported once in the fork server (named here, imported there only): our backend module (torch, vLLM's
# logits processors), and the vLLM modules it imports as it starts the engine (its engine core's with them)
PRELOAD = ("engine.lm.vllm_backend", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm")
_started_at: float | None = None  # time.monotonic() of start() in this process, None before


class CoreProcess(ForkServerProcess):
    """A process forked from the fork server, with the environment this process has at ``start()``."""

    _environ: dict[str, str]

    def start(self) -> None:
        self._environ = dict(os.environ)  # pickled with the process object: the child sets it first
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class CoreContext(ForkServerContext):
    """multiprocessing's fork-server context whose processes are ``CoreProcess``es."""

    Process = CoreProcess  # type: ignore[assignment]


def start(modules: Sequence[str] = PRELOAD) -> None:
    """Start the fork server now, importing ``modules`` there (in its own process: this one goes on at
    once; a module that fails to import there is imported by each child instead). Once a process: where it
    has started (at launch, ``start_first``), nothing."""
    global _started_at
    if started():
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(modules))
    multiprocessing.forkserver.ensure_running()
    _started_at = time.monotonic()
    log.info("fork server started for vLLM's engine core (importing %s)", ", ".join(modules))


def start_first(backend: str, device: str) -> None:
    """At launch, before the server's own imports (torch's, seconds on a GPU host): start the fork server
    where vLLM will likely serve (``backend`` vllm, or auto with vLLM installed and ``device`` not the CPU),
    so vLLM's import there begins at once. The engine's load checks again with the
    device resolved and starts it where this did not; where this guessed wrong (auto on a host without a
    GPU), the server idles with vLLM imported."""
    installed = importlib.util.find_spec("vllm") is not None
    likely = backend == "vllm" or (backend == "auto" and device != "cpu" and installed)
    if likely:
        start()


def started() -> bool:
    """Whether ``start`` ran in this process."""
    return _started_at is not None


def context() -> CoreContext:
    """The context vLLM makes its engine core with (vllm_backend installs it where ``started``)."""
    if _started_at is not None:
        ago = time.monotonic() - _started_at
        log.info("vLLM's engine core forks from the fork server (started %.1f s ago)", ago)
    return CoreContext()
