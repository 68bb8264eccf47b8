"""The studio's script desk in headless Chromium: a two-speaker script typed with a tag inserted by click,
its audio arriving in the live player while it is computed, the words highlighted during playback, and
the SRT / WebVTT subtitles downloaded (a fake engine; the timings are spread by letters)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from engine.text.script import sentences as script_sentences
from server import web
from tests.api.support import RecordingEngine, wait_until
from tests.sounds import write_wav
from tests.webui.support import OUT, WAIT_MS, serving, studio_page

pytestmark = pytest.mark.browser
VOICES_SET = "(() => { const v = document.querySelector('#cosy-sp-voice-1 input'); return v && v.value; })()"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, RecordingEngine]]:
    engine = RecordingEngine(n_chunks=6, chunk_s=0.3, delay_s=0.05)
    wav = write_wav(tmp_path_factory.mktemp("script") / "v.wav", seconds=3.0)
    for name in ("Amy", "Ben"):
        engine.add_voice(name, str(wav), "A prompt.", None)
    with serving(web.create_app(engine, ui_lang="en")) as url:
        yield url, engine


@pytest.fixture
def page(browser, server) -> Iterator[Any]:
    page = studio_page(browser, server[0])
    page.set_viewport_size({"width": 1440, "height": 900})
    yield page
    page.close()


def shoot(page: Any, name: str) -> None:
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / name))  # docs/screens/ holds the committed set


CURSOR_AFTER = """(tag) => { const ta = document.querySelector('#cosy-script-text textarea');
  const end = ta.value.indexOf(tag) + tag.length;
  return document.activeElement === ta && ta.value.includes(tag) && ta.selectionStart === end
    && ta.selectionEnd === end; }"""


def test_a_two_speaker_script_streams_highlights_and_downloads_subtitles(page, server) -> None:
    engine = server[1]
    page.locator("#cosy-script .label-wrap").first.click()
    box = page.locator("#cosy-script-text textarea")
    box.wait_for(timeout=WAIT_MS)
    page.wait_for_function(VOICES_SET, timeout=WAIT_MS)  # the voices' defaults arrived
    box.fill("Alice: Hello Bob, how are you today?\nBob: I am fine. ")
    box.press("End")
    page.locator("#cosy-script-tags button", has_text="[laughter]").click()  # inserted at the cursor
    # the cursor goes right after the tag, in the box: the visitor types on from there
    page.wait_for_function(CURSOR_AFTER, arg="[laughter]", timeout=WAIT_MS)
    box.press_sequentially(" Thanks!")
    box.scroll_into_view_if_needed()
    shoot(page, "scripts-editor.png")
    page.locator("#cosy-script-go").click()
    page.wait_for_function("window.cosyPlayer.stats.samples > 0", timeout=WAIT_MS)  # audio arriving
    page.locator("#cosy-script-result audio").wait_for(timeout=WAIT_MS)
    texts = [r.text for r in engine.requests]
    assert texts == ["Hello Bob, how are you today?", "I am fine. [laughter] Thanks!"]
    assert engine.requests[0].voice_id != engine.requests[1].voice_id
    progress = page.locator("#cosy-script-progress .cosy-progress")
    assert progress.get_attribute("data-done") == "2" and progress.get_attribute("data-total") == "2"
    # playback: the word under the play head is highlighted
    page.evaluate(
        "() => { const a = document.querySelector('#cosy-script-result audio'); const w ="
        " document.querySelectorAll('#cosy-script-result .cosy-w')[3]; a.currentTime ="
        " (parseFloat(w.dataset.s) + parseFloat(w.dataset.e)) / 2; }"
    )
    now = page.locator("#cosy-script-result .cosy-w-now")
    now.wait_for(timeout=WAIT_MS)
    assert now.count() == 1 and now.inner_text() == "are"
    page.locator("#cosy-script-result").scroll_into_view_if_needed()
    shoot(page, "scripts-playback.png")
    links = page.locator("#cosy-script-files a")
    hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
    srt_url = next(h for h in hrefs if h and h.endswith(".srt"))
    vtt_url = next(h for h in hrefs if h and h.endswith(".vtt"))
    srt = page.request.get(srt_url).text()
    vtt = page.request.get(vtt_url).text()
    assert re.match(
        r"1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\nAlice: Hello Bob, how are you today\?\n", srt
    )
    assert vtt.startswith("WEBVTT\n\n") and "I am fine." in re.sub(r"<[^>]+>", "", vtt)
    assert "\n<v Bob>I <" in vtt  # the speaker as a voice span, each word after the first timed
    assert re.fullmatch(r".*/\d{4}-\d\d-\d\d_\d{4}_Alice-Bob_Hello-Bob-how-are-you-today\.srt", srt_url)


def test_stop_ends_a_long_script_and_aborts_its_parts(page, server) -> None:
    engine = server[1]
    page.locator("#cosy-script .label-wrap").first.click()
    page.wait_for_function(VOICES_SET, timeout=WAIT_MS)
    sentence = "This is sentence number {} of a long text, and it goes on for a while."
    sentences = " ".join(sentence.format(i) for i in range(120))
    page.locator("#cosy-script-text textarea").fill(f"Alice: {sentences}")
    before = len(engine.requests)
    page.locator("#cosy-script-go").click()
    page.wait_for_function("window.cosyPlayer.stats.samples > 0", timeout=WAIT_MS)
    done = "+document.querySelector('#cosy-script-progress .cosy-progress').dataset.done >= 1"
    page.wait_for_function(done, timeout=WAIT_MS)  # a sentence whole, so its subtitle is kept too
    page.locator("#cosy-script-stop").click()
    stopped = page.locator('#cosy-script-progress .cosy-progress[data-state="stopped"]')
    stopped.wait_for(timeout=WAIT_MS)  # a stopped state, not "1 / 8 ... about 6 s left"
    assert "Stopped after sentence" in stopped.inner_text() and "left" not in stopped.inner_text()
    assert wait_until(lambda: not engine.active, timeout_s=30)
    # ~0.3 s of compute a part: stopped seconds in, far from the end
    assert len(engine.requests) - before < len(script_sentences(sentences)) // 2
    # the partial take is kept: its audio plays, its files download, its subtitles name the speaker
    page.locator("#cosy-script-result audio").wait_for(timeout=WAIT_MS)
    links = page.locator("#cosy-script-files a")
    links.first.wait_for(timeout=WAIT_MS)
    hrefs = [links.nth(i).get_attribute("href") or "" for i in range(links.count())]
    assert {h.rsplit(".", 1)[-1] for h in hrefs} == {"wav", "srt", "vtt"}
    srt = page.request.get(next(h for h in hrefs if h.endswith(".srt"))).text()
    assert srt.startswith("1\n") and "\nAlice: This is sentence number 0" in srt
