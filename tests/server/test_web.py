"""server.web: what the app's start does before the first request."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START = textwrap.dedent(
    """
    import asyncio, sys
    from server.web import create_app
    from tests.fakes import FakeEngine

    BACKEND = "anyio._backends._asyncio"
    app = create_app(FakeEngine(), studio_later=True)
    before = BACKEND in sys.modules

    async def main():
        async with app.router.lifespan_context(app):
            print(before, BACKEND in sys.modules)

    asyncio.run(main())
    """
)


def test_the_start_imports_anyios_thread_backend_before_any_request() -> None:
    """A fresh process: building the app leaves anyio's asyncio backend unimported, and the app's start
    imports it (its first thread call), so the first request's prompt decode on a worker thread does not."""
    done = subprocess.run(
        [sys.executable, "-c", START], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.split()[-2:] == ["False", "True"], done.stdout + done.stderr
