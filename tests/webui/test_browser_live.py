"""The studio's live-text mode in headless Chromium: the box's words are fed at the chosen rate, what is typed
while it runs follows, and audio plays before the text is complete (a fake engine that speaks per piece)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from engine.request import AudioChunk, SynthesisRequest
from engine.serving.metrics import Stopwatch
from server import web
from tests.fakes import FakeEngine
from tests.webui.support import WAIT_MS, fill_request, player, serving, studio_page
from tests.webui.test_browser import prompt_wav  # noqa: F401 (a fixture)
from webui.live_text import LiveTexts

pytestmark = pytest.mark.browser


class LiveEngine(FakeEngine):
    """Reads the text stream; 0.2 s of audio per piece, as the piece arrives (TTFA from the first piece)."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []
        self.audio_before_end = False

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:  # type: ignore[override]
        assert req.text_stream is not None, "live text must reach the engine as a text stream"
        watch = Stopwatch(req.request_id, 0)
        watch.started()
        n, index = int(0.2 * self.sample_rate), 0
        async for piece in req.text_stream:
            watch.first_text()
            self.pieces.append(piece)
            watch.add_tokens(5)
            watch.add_audio(0.2)
            yield AudioChunk(np.full(n, 0.1, np.float32), self.sample_rate, index, False, watch.snapshot())
            index += 1
            self.audio_before_end = True
        self.completed += 1
        yield AudioChunk(np.zeros(0, np.float32), self.sample_rate, index, True, watch.snapshot(done=True))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, LiveEngine]]:
    engine = LiveEngine()
    idle, LiveTexts.IDLE_S = LiveTexts.IDLE_S, 8.0  # a busy test machine can delay keystrokes by seconds
    try:
        with serving(web.create_app(engine, ui_lang="en")) as url:
            yield url, engine
    finally:
        LiveTexts.IDLE_S = idle


@pytest.fixture
def page(browser, server) -> Iterator[Any]:
    page = studio_page(browser, server[0])
    yield page
    page.close()


def test_live_text_feeds_the_box_as_written_and_plays_before_the_text_ends(page, server, prompt_wav) -> None:  # noqa: F811
    engine = server[1]
    fill_request(page, prompt_wav, text="Pasted words arrive one by one")
    page.locator("#cosy-live-text .label-wrap").click()  # the closed accordion beside the split preview
    page.get_by_label("Live text").check()
    page.locator("#cosy-generate").click()
    page.wait_for_function("window.cosyPlayer.stats.samples > 0", timeout=WAIT_MS)  # sound while text flows
    assert len(engine.pieces) < 6  # 6 words at 4 words/s: the text is not all out yet
    box = page.locator("#cosy-text textarea")
    box.press("End")
    box.press_sequentially(" and typed ones", delay=40)
    page.locator('.cosy-status[data-state="done"]').wait_for(timeout=WAIT_MS)
    assert "".join(engine.pieces) == "Pasted words arrive one by one and typed ones"
    assert engine.audio_before_end
    live = player(page)
    assert live["samples"] == len(engine.pieces) * 4800 and live["firstByteMs"] > 0
