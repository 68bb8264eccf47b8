"""CosyStream server: ``python app.py`` (the ``cosystream`` script) serves the Gradio studio at / and the
HTTP API on one uvicorn server (``server.main.serve``), or with ``--replicas N`` starts Ray Serve replicas of
it (``cluster.application.run_local``) and waits for them. Flags: ``python app.py --help``.

The entry sits above both server/ and cluster/, so cluster/ reuses server/ and nothing points back up.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from server.cli import parse_args
from server.main import config_error, prepare_process, serve


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    prepare_process()
    if args.replicas > 0:  # Ray Serve serves the same app; this process only starts it and waits
        run_replicas(args)
        return
    serve(args)


def run_replicas(args: argparse.Namespace) -> None:
    """Ray loads here, only for a cluster; without it, one line that says what to install."""
    try:
        from cluster.application import run_local
    except ImportError as err:
        if not (err.name or "").startswith("ray"):
            raise
        needs = "pip install -r requirements-cluster.txt"
        config_error(f"--replicas needs Ray Serve ({err.name} is not installed): {needs}")
    run_local(args)


if __name__ == "__main__":
    main()
