"""The studio's modes, failures and first screen in headless Chromium at 1440x900 (issue 38).

- Every ordered pair of modes shows exactly the inputs the second one needs (the mode drives css; no
  listener toggles visibility, so no order of clicks can leave a needed input hidden).
- Each mode's required inputs and Generate are on the first screen in en and zh, also with "Split
  preview" and "Live text" open; screenshots go to ``test-output/`` (the committed set: ``docs/screens/``).
- A failure injected into the engine ends the request visibly: a translated status "failed" with Retry, a
  Generate that works again, and none of the engine's own words on the page.
- With Stream off the finished audio plays by itself.
- The visitor's words win: a transcript they typed survives an upload; one filled for the prompt goes
  when the prompt is cleared.

The app is ``server.web.create_app`` around the fake engine with the shipped example voices, on 127.0.0.1.
Every wait is on the page's state, with ``WAIT_MS`` ceilings.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from engine.request import AudioChunk, SynthesisRequest
from engine.voices import load_examples
from server import web
from tests.fakes import FakeEngine
from tests.sounds import write_wav
from tests.webui.support import OUT, TRANSCRIBED, WAIT_MS, on_top, serving
from webui.texts import Texts

pytestmark = pytest.mark.browser
VIEW = {"width": 1440, "height": 900}
MODES = ("zero_shot", "cross_lingual", "instruct", "vc", "voice")
# what each mode needs on the page (css selectors), and what it must not show
NEEDS = {
    "zero_shot": ("#cosy-prompt", "#cosy-transcript", "#cosy-text"),
    "cross_lingual": ("#cosy-prompt", "#cosy-text"),
    "instruct": ("#cosy-prompt", "#cosy-preset", "#cosy-instruct", "#cosy-text"),
    "vc": ("#cosy-prompt", "#cosy-source"),
    "voice": ("#cosy-voice", "#cosy-text"),
}
INPUTS = sorted({s for needs in NEEDS.values() for s in needs})
LOCALES = {"en": "en-US", "zh": "zh-CN"}
INTERNAL = "flow reuse: a chunk emits frame 349, inside its 350 cached frames"


class StudioEngine(FakeEngine):
    """The fake engine with the shipped example voices; ``fail`` makes the next requests break after one
    chunk the way an engine bug does."""

    def __init__(self) -> None:
        super().__init__(n_chunks=6, chunk_s=0.25, delay_s=0.02)
        self.fail = False

    def example_voices(self) -> list[Any]:
        return list(load_examples())

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:  # type: ignore[override]
        fail = self.fail
        chunks = super().stream(req)
        try:
            async for chunk in chunks:
                yield chunk
                if fail:
                    raise RuntimeError(INTERNAL)
        finally:
            await chunks.aclose()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, StudioEngine]]:
    engine = StudioEngine()
    with serving(web.create_app(engine)) as url:
        yield url, engine


@pytest.fixture
def page_in(browser: Any, server: tuple[str, StudioEngine]) -> Iterator[Any]:
    """``page_in(lang)``: a fresh 1440x900 page on the studio in that language, closed after the test."""
    contexts: list[Any] = []

    def open_page(lang: str = "en") -> Any:
        context = browser.new_context(viewport=VIEW, locale=LOCALES[lang])
        contexts.append(context)
        page = context.new_page()
        page.goto(server[0])
        page.wait_for_function("window.cosyPlayer && document.getElementById('cosy-live')", timeout=WAIT_MS)
        page.locator(".cosy-status", has_text=Texts(lang)("status_idle")).wait_for(timeout=WAIT_MS)
        return page

    yield open_page
    for context in contexts:
        context.close()


def pick(page: Any, mode: str) -> None:
    page.locator(f'#cosy-mode input[value="{mode}"]').check()


def shows_exactly(page: Any, mode: str) -> None:
    """Waits until the needed inputs are visible and every other mode's are hidden."""
    for selector in INPUTS:
        state = "visible" if selector in NEEDS[mode] else "hidden"
        page.locator(selector).first.wait_for(state=state, timeout=WAIT_MS)


def test_every_mode_pair_shows_exactly_the_inputs_it_needs(page_in) -> None:
    page = page_in("en")
    shows_exactly(page, "zero_shot")
    for first, second in itertools.permutations(MODES, 2):
        pick(page, first)
        pick(page, second)  # at once, before anything of the first could have settled
        shows_exactly(page, second)
    shown = [m for m in MODES if page.locator(f".cosy-note.cosy-for-{m}").is_visible()]
    assert shown == [second]  # the help line follows the mode too


def in_view(page: Any, selector: str) -> bool:
    box = page.locator(selector).first.bounding_box()
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= VIEW["height"]


def open_accordions(page: Any, t: Texts) -> None:
    for key in ("split_preview", "live_text"):
        page.get_by_text(t(key), exact=True).first.click()
    page.get_by_text(t("live_wps"), exact=True).first.wait_for(timeout=WAIT_MS)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_each_mode_fits_one_screen_with_the_accordions_open(page_in, lang) -> None:
    page, t = page_in(lang), Texts(lang)
    page.locator("#cosy-generate", has_text=t("generate")).wait_for(timeout=WAIT_MS)
    OUT.mkdir(exist_ok=True)
    for accordions in (False, True):
        if accordions:
            open_accordions(page, t)
        for mode in MODES:
            pick(page, mode)
            shows_exactly(page, mode)
            for selector in (*NEEDS[mode], "#cosy-generate", "#cosy-stop"):
                assert in_view(page, selector), f"{lang} {mode}: {selector} is off the 1440x900 screen"
                assert on_top(page, selector), f"{lang} {mode}: {selector} is covered"
            if "#cosy-text" in NEEDS[mode]:  # closed, the live-text controls are seen on the first screen
                assert accordions or on_top(page, "#cosy-live-text"), f"{lang} {mode}: live text covered"
            if not accordions:
                name = f"studio-{lang}-{mode}-1440x900.png"
                page.screenshot(path=str(OUT / name))  # docs/screens/ holds the committed set


def fill_example(page: Any, text: str = "A short line to speak.") -> None:
    page.locator("#cosy-examples").get_by_text("en-amy", exact=True).click()
    page.wait_for_function(TRANSCRIBED, timeout=WAIT_MS)
    page.locator("#cosy-text textarea").fill(text)


# textContent, not innerText: innerText depends on layout (a toast read in the mutation that inserts it
# is mid-transition); once, in a full suite on 2 cores, no recorded text held the message the status showed
TOAST_RECORDER = """() => {
  window.cosyToasts = [];
  const seen = () =>
    document.querySelectorAll(".toast-body").forEach((t) => window.cosyToasts.push(t.textContent));
  new MutationObserver(seen).observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_an_engine_failure_ends_the_request_visibly(page_in, server, lang) -> None:
    _, engine = server
    page, t = page_in(lang), Texts(lang)
    fill_example(page)
    # the toast closes after 10 s: every toast's text is recorded as it appears, so a loaded machine that
    # looks late (a full suite on 2 cores did) still sees what it said
    page.evaluate(TOAST_RECORDER)
    engine.fail = True
    try:
        page.locator("#cosy-generate").click()
        failed = page.locator('.cosy-status[data-state="failed"]')
        failed.wait_for(timeout=WAIT_MS)
    finally:
        engine.fail = False
    assert t("err_internal") in failed.inner_text()  # the status and the toast both say it
    toasts = "(said) => window.cosyToasts.some((text) => text.includes(said))"
    page.wait_for_function(toasts, arg=t("err_internal"), timeout=WAIT_MS)
    page.locator("#cosy-retry").wait_for(state="visible", timeout=WAIT_MS)
    body = page.locator("body").inner_text()
    assert "frame 349" not in body and "RuntimeError" not in body
    assert page.locator("#cosy-generate").is_enabled()
    page.locator('#cosy-live[data-state="error"]').wait_for(timeout=WAIT_MS)  # the live card says so too
    page.locator("#cosy-retry").click()  # the engine works again: Retry runs the same request
    page.locator('.cosy-status[data-state="done"]').wait_for(timeout=WAIT_MS)
    assert page.locator("#cosy-retry").is_hidden()


def test_stream_off_plays_the_finished_audio(page_in) -> None:
    page = page_in("en")
    fill_example(page)
    page.locator("#cosy-stream input[type=checkbox]").uncheck()
    page.locator("#cosy-generate").click()
    page.locator('.cosy-status[data-state="done"]').wait_for(timeout=WAIT_MS)
    # the page's player plays the finished file by itself (no streamed PCM was read: no stream)
    page.wait_for_function("window.cosyPlayer.stats.state === 'playing'", timeout=WAIT_MS)
    stats = page.evaluate("window.cosyPlayer.stats")
    assert stats["scheduledS"] == pytest.approx(6 * 0.25, abs=0.01) and stats["bytes"] == 0
    page.wait_for_function("window.cosyPlayer.stats.state === 'done'", timeout=WAIT_MS)  # heard to the end


def test_the_visitors_transcript_wins(page_in, tmp_path) -> None:
    page = page_in("en")
    prompt = str(write_wav(tmp_path / "p.wav", 4.0))
    transcript = page.locator("#cosy-transcript textarea")
    transcript.fill("my own words")
    page.locator("#cosy-prompt input[type=file]").set_input_files(prompt)
    page.locator("#cosy-asr-note", has_text="Kept the transcript you typed").wait_for(timeout=WAIT_MS)
    assert transcript.input_value() == "my own words"
    page.locator("#cosy-prompt button[aria-label='Clear']").first.click()
    page.locator("#cosy-asr-note", has_text="Kept").wait_for(state="detached", timeout=WAIT_MS)
    assert transcript.input_value() == "my own words"  # typed: it stays with the prompt cleared
    transcript.fill("")
    page.locator("#cosy-prompt input[type=file]").set_input_files(prompt)
    page.wait_for_function(
        "document.querySelector('#cosy-transcript textarea').value === 'fake transcript'", timeout=WAIT_MS
    )
    page.locator("#cosy-prompt button[aria-label='Clear']").first.click()
    page.wait_for_function(
        "document.querySelector('#cosy-transcript textarea').value === ''", timeout=WAIT_MS
    )
