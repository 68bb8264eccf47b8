"""Headless Chromium for the browser tests (Debian's chromium through Playwright)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    with playwright_api.sync_playwright() as p:
        args = ["--no-sandbox", "--autoplay-policy=no-user-gesture-required"]
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield chromium
        chromium.close()
