"""The server's entry point (``python app.py``, the ``cosystream`` script): one process serving the studio
and the API, or, with ``--replicas N``, Ray Serve replicas of it (``cluster/``), which this process starts and
waits for. The launcher sits above both, so ``cluster/`` can reuse ``server.cli`` and ``server.web``."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from types import FrameType

from engine.config import DEMO_TINY
from engine.serving.startup import Timeline  # stdlib only: its import marks the launch
from server.cli import build_engine, engine_config, parse_args
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


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack to the log, the server serving on
        signal.signal(signal.SIGUSR1, log_stacks)
    if args.replicas > 0:  # Ray Serve serves the same app; this process only starts it and waits
        from cluster.application import run_local

        run_local(args)
        return
    cfg = engine_config(args)
    log.info("starting CosyStream: model %s, device %s", cfg.model, cfg.device)
    timeline = Timeline()  # the engine's phases, timed from this process's launch
    # the server listens first (/health answers at once, /ready once warm); the engine loads behind it
    # Gradio imported while the engine waits for vLLM's start (where it waits), not beside the first requests
    studio = (("studio import", import_studio),)
    engine = PendingEngine(cfg.model, lambda: build_engine(cfg, timeline, studio), timeline)
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
