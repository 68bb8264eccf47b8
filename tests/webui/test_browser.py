"""The studio end to end in headless Chromium: upload, Generate with streaming, audio plays, metrics show
numbers, Stop aborts the engine mid-stream, a missing prompt shows its error.

The app is ``server.web.create_app`` around a slow fake engine on 127.0.0.1 (a later switch:
``--model demo-tiny``).
Writes ``test-output/webui-studio.png`` and ``test-output/webui-latency.json`` (click -> first sound in the
browser vs the server's time to first audio).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from engine.request import SynthesisRequest
from engine.serving.metrics import ServerStats
from server import web
from tests.fakes import FakeEngine
from tests.sounds import write_wav
from tests.webui.support import OUT, WAIT_MS, fill_request, metric, on_top, player, serving, studio_page

pytestmark = pytest.mark.browser


class BrowserEngine(FakeEngine):
    """40 chunks of 0.2 s, one per 80 ms (RTF 0.4): long enough to press Stop mid-stream."""

    def __init__(self) -> None:
        super().__init__(n_chunks=40, chunk_s=0.2, delay_s=0.08)
        self.audio_total = 0.0

    async def stream(self, req: SynthesisRequest) -> AsyncIterator:  # type: ignore[override]
        async for chunk in super().stream(req):
            self.audio_total += chunk.seconds
            yield chunk

    def stats(self) -> ServerStats:
        return ServerStats(
            active_streams=len(self.active), completed=self.completed, audio_s_total=self.audio_total
        )


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, BrowserEngine]]:
    engine = BrowserEngine()
    with serving(web.create_app(engine, ui_lang="en", random_weights=True)) as url:
        yield url, engine


@pytest.fixture
def page(browser, server) -> Iterator[Any]:
    page = studio_page(browser, server[0])
    yield page
    page.close()


@pytest.fixture(scope="module")
def prompt_wav(tmp_path_factory) -> str:
    return str(write_wav(tmp_path_factory.mktemp("browser") / "prompt.wav", seconds=4.0))


def test_missing_prompt_shows_the_error(page) -> None:
    fill_request(page, None)
    page.locator("#cosy-generate").click()
    page.get_by_text("A prompt voice is needed").first.wait_for(timeout=WAIT_MS)
    page.wait_for_function("window.cosyPlayer.stats.state === 'idle'", timeout=WAIT_MS)  # player released


def test_streams_plays_and_shows_metrics(page, server, prompt_wav) -> None:
    engine = server[1]
    fill_request(page, prompt_wav)
    page.locator("#cosy-generate").click()
    page.wait_for_function("window.cosyPlayer.stats.playedS > 0.3", timeout=WAIT_MS)
    page.locator('.cosy-status[data-state="done"]').wait_for(timeout=WAIT_MS)
    live = player(page)
    expected_samples = engine.n_chunks * int(engine.chunk_s * engine.sample_rate)
    assert live["sampleRate"] == engine.sample_rate and live["samples"] == expected_samples
    assert live["bytes"] == 2 * expected_samples
    assert 0 < live["firstByteMs"] <= live["firstPlayMs"] <= live["firstSoundMs"]
    server_ttfa, browser_ttfa = metric(page, "ttfa_server"), live["firstSoundMs"]
    assert metric(page, "rtf") > 0 and metric(page, "audio_s") == pytest.approx(8.0)
    assert metric(page, "tokens_s") > 0 and metric(page, "lm_tokens") == 200
    parts = [metric(page, f"ttfa_{k}") for k in ("queue", "frontend", "lm", "t2w_wait", "t2w_compute")]
    assert sum(parts) == pytest.approx(server_ttfa, abs=5)  # the parts line adds up to the server TTFA
    page.wait_for_function(
        "getComputedStyle(document.documentElement).getPropertyValue('--cosy-bttfa').includes('ms')"
    )
    wav = page.locator('.cosy-history a[href$=".wav"]').first.get_attribute("href")
    download = page.request.get(server[0] + wav)
    assert download.status == 200 and download.headers["content-type"] == "audio/wav"
    mp3 = page.request.get(server[0] + wav.replace(".wav", ".mp3"))
    assert mp3.status == 200 and len(mp3.body()) > 1000
    page.wait_for_function("window.cosyPlayer.stats.playedS > 1.0")  # keeps playing after the server is done
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "webui-studio.png"), full_page=True)
    numbers = {"server_ttfa_ms": server_ttfa, "click_to_first_sound_ms": round(browser_ttfa, 1)}
    numbers["browser_overhead_ms"] = round(browser_ttfa - server_ttfa, 1)
    numbers |= {k: round(live[k], 1) for k in ("firstByteMs", "firstPlayMs")}
    numbers["underruns"] = live["underruns"]
    (OUT / "webui-latency.json").write_text(json.dumps(numbers, indent=2))
    print(f"\nserver TTFA {server_ttfa:.0f} ms; click -> first sound in the browser {browser_ttfa:.0f} ms")


def test_stop_aborts_the_engine_mid_stream(page, server, prompt_wav) -> None:
    engine = server[1]
    fill_request(page, prompt_wav)
    page.locator("#cosy-generate").click()
    page.wait_for_function("window.cosyPlayer.stats.samples > 0", timeout=WAIT_MS)
    rid = player(page)["rid"]
    page.locator("#cosy-stop").click()
    page.locator('.cosy-status[data-state="stopped"]').wait_for(timeout=WAIT_MS)
    assert rid in engine.aborted and rid not in engine.active
    live = player(page)
    assert live["state"] == "stopped" and 0 < live["samples"] < engine.n_chunks * 4800
    time.sleep(0.3)
    assert player(page)["samples"] == live["samples"]  # nothing more arrives


def test_the_demos_first_screen_shows_the_live_text_controls_and_generate(browser, server) -> None:
    """At 1440x900 with the demo's banner, the sticky Generate card covers nothing a visitor needs first:
    the text box, the split-preview and live-text controls, Generate and Stop are all seen at once."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        page.goto(server[0])
        page.wait_for_function("window.cosyPlayer && document.getElementById('cosy-live')", timeout=WAIT_MS)
        for selector in ("#cosy-text", "#cosy-live-text", "#cosy-generate", "#cosy-stop"):
            assert on_top(page, selector), f"{selector} is covered on the first screen"
    finally:
        page.close()
