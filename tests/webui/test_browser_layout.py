"""The studio on a phone and by keyboard in headless Chromium (issue 54, items 3 and 4).

- 390x844 (zh): one column, nothing wider than the window before and after two takes (the history table
  scrolls inside its own box), Generate in a bar at the window's bottom; Gradio's English aria-labels are
  in Chinese on the Chinese page, also on the result's audio player.
- 1440x900: the sticky Generate bar covers no field, with ~1,900 characters of text and with a field
  focused by Tab (``elementFromPoint`` at each field's centre is the field).
- Keyboard: the five modes are one Tab stop whose arrows move the mode; an example voice is picked with
  Enter; Ctrl+Enter runs the take.

The app is ``server.web.create_app`` around the fake engine with the shipped example voices. Every wait is
on the page's state, with ``WAIT_MS`` ceilings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from engine.voices import load_examples
from server import web
from tests.fakes import FakeEngine
from tests.webui.support import OUT, WAIT_MS, on_top, serving

pytestmark = pytest.mark.browser
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1440, "height": 900}
LOCALES = {"en": "en-US", "zh": "zh-CN"}
# the Chinese page's aria-labels and titles may keep these Latin words: names and units
LATIN_OK = {"HiFT", "RTF", "TTFA", "CosyStream", "Gradio", "API", "wav", "mp3", "SRT", "WebVTT", "Hz", "ms"}
# every field of the page that the window shows: its centre is the field itself (or inside it)
UNCOVERED_JS = """() => {
  const bad = [];
  for (const e of document.querySelectorAll('input:not([type=hidden]), textarea, select')) {
    const r = e.getBoundingClientRect();
    if (!r.width || !r.height || e.closest('.cosy-actions')) continue;
    const x = r.x + r.width / 2, y = r.y + r.height / 2;
    if (y < 0 || y > innerHeight || x < 0 || x > innerWidth) continue;
    const hit = document.elementFromPoint(x, y);
    const own = hit && (e.contains(hit) || (e.labels && [...e.labels].some((l) => l.contains(hit))));
    const where = e.closest('[id]') ? e.closest('[id]').id : '';
    if (!own) bad.push(`${where} ${e.type} under ${hit && hit.className}`);
  }
  return bad;
}"""
FOCUSED_UNCOVERED_JS = """() => {
  const e = document.activeElement, r = e.getBoundingClientRect();
  return e.contains(document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2));
}"""


class ExampleEngine(FakeEngine):
    def example_voices(self) -> list[Any]:
        return list(load_examples())


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ExampleEngine]]:
    engine = ExampleEngine(n_chunks=4, chunk_s=0.25, delay_s=0.02)
    with serving(web.create_app(engine)) as url:
        yield url, engine


@pytest.fixture
def page_at(browser: Any, server: tuple[str, ExampleEngine]) -> Iterator[Any]:
    """``page_at(viewport, lang)``: a fresh page on the studio in ``lang``, closed after the test."""
    contexts: list[Any] = []

    def open_page(viewport: dict[str, int], lang: str = "en") -> Any:
        context = browser.new_context(viewport=viewport, locale=LOCALES[lang])
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(server[0])
        page.wait_for_function("window.cosyPlayer && document.getElementById('cosy-live')")
        page.locator(f'.cosy-header[data-lang="{lang}"]').wait_for()  # the page in its language
        return page

    yield open_page
    for context in contexts:
        context.close()


def page_width(page: Any) -> int:
    return int(page.evaluate("document.documentElement.scrollWidth"))


def take(page: Any, rows: int) -> None:
    """Generate (through the bar at the window's bottom) and wait for the take's history row."""
    page.locator("#cosy-generate").click()
    page.wait_for_function(f"document.querySelectorAll('.cosy-history tbody tr').length === {rows}")


def latin_labels(page: Any) -> list[str]:
    labels = page.evaluate(
        "Array.from(document.querySelectorAll('[aria-label], [title]'))"
        ".flatMap((e) => [e.getAttribute('aria-label'), e.getAttribute('title')]).filter(Boolean)"
    )
    names = [e.name for e in load_examples()]  # voices' names are names

    def words(label: str) -> set[str]:
        for name in names:
            label = label.replace(name, "")
        return set(re.findall(r"[A-Za-z]{2,}", label))

    return [s for s in labels if words(s) - LATIN_OK]


def test_a_phone_shows_one_column_before_and_after_two_takes(page_at) -> None:
    page = page_at(PHONE, "zh")
    assert page_width(page) <= PHONE["width"]
    bar = page.locator("#cosy-generate").bounding_box()
    assert bar is not None and bar["y"] + bar["height"] <= PHONE["height"]  # on the first screen
    assert bar["y"] > PHONE["height"] / 2  # at the bottom, under the thumb
    page.locator("#cosy-examples").get_by_text("en-amy", exact=True).click()
    page.wait_for_function("document.querySelector('#cosy-transcript textarea').value !== ''")
    page.locator("#cosy-text textarea").fill("第一句话，用来测试手机上的布局。")
    take(page, 1)
    page.locator("#cosy-text textarea").fill("第二句话：历史表格在自己的框里滚动，页面本身不会横向滚动。")
    take(page, 2)
    page.locator('.cosy-status[data-state="done"]').wait_for()
    assert page_width(page) <= PHONE["width"]
    table = page.locator(".cosy-history")
    assert table.evaluate("(t) => t.getBoundingClientRect().right") <= PHONE["width"]
    page.locator("#cosy-result audio, #cosy-result [aria-label]").first.wait_for(state="attached")
    page.wait_for_function("new Promise((ok) => requestAnimationFrame(() => ok(true)))")  # keys.js's pass
    assert latin_labels(page) == [], "\n".join(latin_labels(page))
    OUT.mkdir(exist_ok=True)
    page.locator(".cosy-history").scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "studio-zh-390x844-history.png"))


def test_the_sticky_bar_covers_no_field_at_1440x900(page_at) -> None:
    page = page_at(DESKTOP, "en")
    assert page.evaluate(UNCOVERED_JS) == []
    text = page.locator("#cosy-text textarea")
    text.fill(("A long text to speak, one sentence after another. " * 40)[:1899] + ".")
    page.locator(".cosy-counter", has_text="1900 /").wait_for()  # the box has grown with the text
    assert page.evaluate(UNCOVERED_JS) == []
    for selector in ("#cosy-generate", "#cosy-stop"):  # and no label paints over the bar
        assert on_top(page, selector), f"{selector} is covered"
    # every field after the text reached by Tab is scrolled where the bar does not cover it
    text.focus()
    seen = set()
    for _ in range(12):
        page.keyboard.press("Tab")
        name = page.evaluate("document.activeElement.closest('[id]')?.id + ':' + document.activeElement.type")
        seen.add(name)
        if page.evaluate("document.activeElement.matches('input, textarea')"):
            assert page.evaluate(FOCUSED_UNCOVERED_JS), f"{name} is focused under the sticky bar"
    assert any(s.endswith(":number") for s in seen), f"Tab never reached the seed: {seen}"
    page.locator('#cosy-mode input[value="voice"]').check()
    page.locator("#cosy-voice").wait_for()
    assert page.evaluate(UNCOVERED_JS) == []


def test_tab_arrows_and_ctrl_enter_drive_a_take(page_at) -> None:
    page = page_at(DESKTOP, "en")
    mode = page.locator('#cosy-mode input[value="zero_shot"]')
    page.locator(".cosy-header").click()  # start from the page, not from a field
    for _ in range(10):
        page.keyboard.press("Tab")
        if page.evaluate("!!document.activeElement.closest('#cosy-mode')"):
            break
    assert mode.evaluate("(e) => e === document.activeElement"), "Tab never reached the modes"
    page.keyboard.press("ArrowRight")
    page.locator('#cosy-mode input[value="cross_lingual"][aria-checked="true"]').wait_for()
    page.keyboard.press("ArrowLeft")
    page.locator('#cosy-mode input[value="zero_shot"][aria-checked="true"]').wait_for()
    page.keyboard.press("Tab")  # one Tab stop for the five modes: the next one leaves the group
    assert not page.evaluate("!!document.activeElement.closest('#cosy-mode')")
    for _ in range(10):  # on to the example voices: Enter picks one
        if page.evaluate("document.activeElement.innerText === 'en-amy'"):
            break
        page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#cosy-transcript textarea').value !== ''")
    text = page.locator("#cosy-text textarea")
    text.focus()
    page.keyboard.press("Control+A")  # in place of the example's text
    page.keyboard.type("Typed, then sent with the keyboard.")
    ring = page.evaluate("getComputedStyle(document.activeElement).outlineWidth")
    assert ring == "3px"  # a visible focus ring
    page.keyboard.press("Control+Enter")
    page.locator('.cosy-status[data-state="done"]').wait_for()
    assert page.locator(".cosy-history tbody tr").count() == 1
    assert "Typed, then sent" in page.locator(".cosy-history").inner_text()


def test_the_voice_library_plays_saves_deletes_and_undoes(page_at, server) -> None:
    page, engine = page_at(DESKTOP, "en"), server[1]
    library = page.locator("#cosy-examples")
    library.locator('.cosy-vcard[data-voice="en-ben"] [data-lib-op="play"]').click()
    page.locator('#cosy-examples .cosy-vcard[data-voice="en-ben"][data-playing]').wait_for()  # it plays
    library.get_by_text("en-amy", exact=True).click()  # a card's name uses it: the prompt is filled
    page.wait_for_function("document.querySelector('#cosy-transcript textarea').value !== ''")
    page.get_by_label("Save this prompt as").fill("Amy again")
    page.locator("#cosy-save").click()
    own = library.locator('.cosy-vcard[data-kind="own"]', has_text="Amy again")
    own.wait_for()
    page.locator(".cosy-lib-note", has_text="Saved voice “Amy again”").wait_for()  # at the column's top
    assert len(engine.voices) == 1
    own.locator('[data-lib-op="delete"]').click()
    library.locator('[data-lib-op="undo"]').wait_for()
    assert own.count() == 0 and len(engine.voices) == 0  # gone, and Undo offered
    library.locator('[data-lib-op="undo"]').click()
    page.locator(".cosy-lib-note", has_text="Restored voice “Amy again”").wait_for()
    assert own.count() == 1 and [v.name for v in engine.voices.values()] == ["Amy again"]
    page.locator('#cosy-mode input[value="voice"]').check()
    own.locator(".cosy-vname").click()  # in Saved voice mode the card is picked in the list
    page.wait_for_function("document.querySelector('#cosy-voice input').value === 'Amy again'")
