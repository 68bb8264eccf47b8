"""Helpers shared by the browser tests (a plain module: importing it never skips or starts anything)."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import WAIT_S

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "test-output"
# how long a test waits for what the page must show; a loaded 2-core CI machine once took over 10 s for a
# transcript or an error that arrive in about a second alone (a wait ends as soon as its condition holds)
WAIT_MS = int(WAIT_S * 1000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(fastapi_app: Any, start_s: float = WAIT_S) -> Iterator[str]:
    """The app on a free 127.0.0.1 port in a thread, its URL while the block runs, then stopped."""
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(fastapi_app, "127.0.0.1", free_port(), log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_s
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the app did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.config.port}/"
    finally:
        srv.should_exit = True
        thread.join(10)


def studio_page(browser: Any, url: str, errors: list[str] | None = None) -> Any:
    """A 1400x1000 page on the studio (a fresh context: nothing cached), once its player script has loaded.
    ``errors`` collects the page's uncaught script errors, from before it starts loading."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(WAIT_MS)  # every wait, click and fill: a ceiling, not a schedule
    if errors is not None:
        page.on("pageerror", lambda err: errors.append(f"{err}\n{err.stack or ''}"))
    page.goto(url)
    page.wait_for_function("window.cosyPlayer && document.getElementById('cosy-live')", timeout=WAIT_MS)
    return page


def on_top(page: Any, selector: str) -> bool:
    """What the window shows near the element's top centre is the element (the sticky Generate card may
    cover what lies above it in the column)."""
    js = (
        "(e) => { const r = e.getBoundingClientRect(), y = r.y + Math.min(r.height / 2, 12);"
        " return e.contains(document.elementFromPoint(r.x + r.width / 2, y)); }"
    )
    return bool(page.locator(selector).first.evaluate(js))


TRANSCRIBED = "document.querySelector('#cosy-transcript textarea').value !== ''"


def fill_request(page: Any, prompt: str | None, text: str = "Hello there. This is a streaming test!") -> None:
    if prompt:
        page.locator("#cosy-prompt input[type=file]").set_input_files(prompt)
        page.locator(".cosy-note.cosy-good").first.wait_for(timeout=WAIT_MS)  # duration: "4.0 s ... ok"
        # the upload is transcribed into the field: wait for it, so it cannot overwrite what is typed next
        page.wait_for_function(TRANSCRIBED, timeout=WAIT_MS)
        page.locator("#cosy-transcript textarea").fill("this is the prompt")
    page.locator("#cosy-text textarea").fill(text)


def player(page: Any) -> dict[str, Any]:
    return page.evaluate("window.cosyPlayer.stats")


def metric(page: Any, key: str) -> float:
    text = page.locator(f'[data-metric="{key}"]').first.inner_text()
    number = re.match(r"[\d,.]+", text.strip())
    assert number, f"{key} shows {text!r}, not a number"
    return float(number.group().replace(",", ""))
