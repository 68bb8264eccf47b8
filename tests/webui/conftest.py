"""Headless Chromium for the browser tests (Debian's chromium through Playwright).

Chromium is whatever ``chromium`` the PATH finds: without one (or without playwright) every test that asks
for ``browser`` skips, with the reason, instead of erroring."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    chromium_path = shutil.which("chromium")
    if chromium_path is None:
        pytest.skip("no chromium on the PATH (Debian: apt-get install -y chromium)")
    with playwright_api.sync_playwright() as p:
        args = ["--no-sandbox", "--autoplay-policy=no-user-gesture-required"]
        chromium = p.chromium.launch(executable_path=chromium_path, args=args)
        yield chromium
        chromium.close()
