"""A lexicon from the prompt lab in the studio, in headless Chromium over demo-tiny: saved in the lab, a
take promoted with "Use in studio" (its voice and its lexicon picked there), and the studio's Generate
speaking the text with the lexicon's hint where the brand name was, its status saying so."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.demo.make_model import build_model_dir
from engine.request import SynthesisRequest
from engine.serving.engine import TTSEngine
from server import web
from tests.webui.support import WAIT_MS, serving

pytestmark = pytest.mark.browser
TEXT = "Nike makes shoes."
HINT = "[N][AY1][K][IY0]"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, Any]]:
    root = tmp_path_factory.mktemp("lexstudio")
    model = build_model_dir(root / "m", "cosyvoice3", "tiny")
    cfg = EngineConfig(model=str(model), device="cpu", backend="native", voices_dir=str(root / "v"))
    engine = TTSEngine.load(cfg)
    engine.asked = []  # every request the engine was given, as given
    stream = engine.stream

    def spy(req: SynthesisRequest) -> Any:
        engine.asked.append(req)
        return stream(req)

    engine.stream = spy  # type: ignore[method-assign]
    with serving(web.create_app(engine, ui_lang="en")) as url:
        yield url.rstrip("/"), engine


def test_a_lab_lexicon_and_voice_promoted_to_the_studio_are_used_by_generate(browser, server) -> None:
    url, engine = server
    errors: list[str] = []
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(f"{url}/lab?lang=en")
    page.wait_for_selector("body[data-ready='1']", state="attached")

    page.fill("#lab-text", TEXT)
    page.fill("#lab-lex-name", "Brands")
    page.fill("#lab-lex-entries", "Nike = N AY1 K IY0")
    page.click("#lab-lex-save")
    page.wait_for_function("document.getElementById('lab-lexicon').options.length > 1")
    page.select_option("#lab-lexicon", "brands")
    voice = page.eval_on_selector_all("#lab-voice option", "os => os.map(o => o.value).filter(Boolean)")[-1]
    page.select_option("#lab-voice", voice)
    page.click("#lab-generate")
    page.wait_for_selector("#lab-results[data-done='true']")
    page.locator(".lab-result").first.locator("[data-act=promote]").click()

    # the studio: the take's text, its voice (Saved voice mode) and its lexicon picked, once loaded
    page.wait_for_function("window.cosyLabPromoted !== undefined")
    page.wait_for_function("document.querySelector('#cosy-lexicon input').value === 'Brands'")
    assert page.locator("#cosy-mode input[value=voice]").is_checked()
    page.wait_for_function("document.querySelector('#cosy-voice input').value !== ''")
    assert page.input_value("#cosy-text textarea") == TEXT
    engine.asked.clear()
    page.click("#cosy-generate")
    page.wait_for_selector(".cosy-status[data-state=done]")
    assert "Pronounced from the lexicon: Nike×1." in page.inner_text(".cosy-status")
    asked = engine.asked[-1]
    assert asked.text == f"{HINT} makes shoes." and asked.voice_id == voice
    assert errors == []
    context.close()
