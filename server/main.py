"""The single-process server: the studio and the API on one uvicorn server over one engine (``serve``),
and what every launch sets up first (``prepare_process``). ``app.py`` (the ``cosystream`` script) picks
this or, with ``--replicas N``, Ray Serve replicas (``cluster/``); this package never imports cluster/,
which reuses ``server.cli`` and ``server.web``: the dependency points one way."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import NoReturn

from engine.config import DEMO_TINY
from engine.errors import ModelError
from engine.lm import fork_server
from engine.serving.startup import Timeline  # stdlib only: its import marks the launch
from server.cli import build_engine, engine_config
from server.pending_engine import PendingEngine
from server.web import create_app, import_studio, open_share_link, web_server

log = logging.getLogger("cosystream")


def log_stacks(signum: int, frame: FrameType | None) -> None:
    """Every thread's Python stack to the log. Python runs this on the main thread between two bytecodes;
    faulthandler's dump, which reads running threads' frames from the signal itself, crashed a serving
    process on the H200 (a segfault in _Py_DumpTracebackThreads)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, top in sys._current_frames().items():
        stack = "".join(traceback.format_stack(top))
        log.warning("stack of thread %s (signal %d):\n%s", names.get(ident, ident), signum, stack)


def config_error(message: str) -> NoReturn:
    """One line that says what to fix, and the status a supervisor does not restart on."""
    from server.shutdown import EXIT_CONFIG  # uvicorn's import: not at app.py's import

    log.critical("cannot start: %s", message)
    sys.exit(EXIT_CONFIG)


def check_model_dir(model: str, llm_variant: str) -> None:
    """A ``--model`` that names a local path must be a complete model directory, checked before the server
    listens (file names only: milliseconds); a hub id is resolved by the load."""
    from engine.hub import validate_model_dir

    looks_local = model.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(model))
    if model == DEMO_TINY or not looks_local:
        return
    try:
        validate_model_dir(model, llm_variant)
    except ModelError as err:
        config_error(f"{err} (fix --model: a CosyVoice2/3 model directory, a hub id, or demo-tiny)")


def prepare_process() -> None:
    """Logging, and `kill -USR1 PID` (every thread's stack to the log, the server serving on), before
    anything reads the engine's configuration: a slow start can be looked into from its first second."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, log_stacks)


def serve(args: argparse.Namespace) -> None:
    """One process serving the studio and the API until SIGINT / SIGTERM; ``args`` from ``server.cli``."""
    if args.replicas > 0:
        raise ValueError("--replicas runs on Ray Serve: start it with app.py / cosystream, not server.serve")
    cfg = engine_config(args)
    check_model_dir(cfg.model, cfg.llm_variant)
    log.info("starting CosyStream: model %s, device %s", cfg.model, cfg.device)
    if cfg.lm_fork_server:  # vLLM's import in its own process from now on, beside this one's
        fork_server.start_first(cfg.backend, cfg.device)
    timeline = Timeline(profile_to=args.profile_startup)  # the engine's phases, timed from launch
    # the server listens first (/health answers at once, /ready once warm); the engine loads behind it
    # Gradio imported while the engine waits for vLLM's start (where it waits), not beside the first requests
    studio = (("studio import", import_studio),)
    engine = PendingEngine(cfg.model, lambda: build_engine(cfg, timeline, studio), timeline)
    # a phase of its own: the API's import brings torch in before the engine's thread starts (seconds on a
    # GPU host), which the timeline would otherwise count as nobody's
    with timeline.phase("web app"):
        app = create_app(
            engine, ui_lang=args.ui_lang, limits=cfg.limits, api_key=args.api_key,
            random_weights=cfg.model == DEMO_TINY, studio_later=True,
        )  # fmt: skip
    if args.share:
        open_share_link(args.host, args.port)
    server = web_server(app, args.host, args.port, cfg.model, engine, args.shutdown_grace_s)
    server.run()
    from server.shutdown import leave

    leave(server.exit_status)  # the server has stopped and the engine is closed
