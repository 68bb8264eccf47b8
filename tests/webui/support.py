"""Helpers shared by the browser tests (a plain module: importing it never skips or starts anything)."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "test-output"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRANSCRIBED = "document.querySelector('#cosy-transcript textarea').value !== ''"


def fill_request(page: Any, prompt: str | None, text: str = "Hello there. This is a streaming test!") -> None:
    if prompt:
        page.locator("#cosy-prompt input[type=file]").set_input_files(prompt)
        page.locator(".cosy-note.cosy-good").first.wait_for(timeout=10_000)  # duration: "4.0 s ... ok"
        # the upload is transcribed into the field: wait for it, so it cannot overwrite what is typed next
        page.wait_for_function(TRANSCRIBED, timeout=60_000)
        page.locator("#cosy-transcript textarea").fill("this is the prompt")
    page.locator("#cosy-text textarea").fill(text)


def player(page: Any) -> dict[str, Any]:
    return page.evaluate("window.cosyPlayer.stats")


def metric(page: Any, key: str) -> float:
    text = page.locator(f'[data-metric="{key}"]').first.inner_text()
    number = re.match(r"[\d,.]+", text.strip())
    assert number, f"{key} shows {text!r}, not a number"
    return float(number.group().replace(",", ""))
