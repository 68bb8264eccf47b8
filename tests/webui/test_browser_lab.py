"""The prompt lab in headless Chromium over demo-tiny: a 4-take comparison made together, two takes played,
a favourite, the copied Python snippet run against the server (the take's audio again), the share link in
a second browser context, blind rating, and a lexicon tried on the text."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from engine.config import EngineConfig
from engine.demo.make_model import build_model_dir
from engine.serving.engine import TTSEngine
from server import web
from tests.conftest import WAIT_S
from tests.webui.support import WAIT_MS, serving

pytestmark = pytest.mark.browser
TEXT = "The lab compares Nike takes."
# Takes made together share the engine's batches; alone the same request computes the same numbers up to
# float reassociation in batched matmuls: a sample-wise tolerance well under one 16-bit step times 50.
ATOL = 50 / 32768


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("lab")
    model = build_model_dir(root / "m", "cosyvoice3", "tiny")
    cfg = EngineConfig(model=str(model), device="cpu", backend="native", voices_dir=str(root / "v"))
    engine = TTSEngine.load(cfg)
    engine.lm_inputs = []  # the text ids of every segment the speech LM is given (the planner's output)
    assemble = engine.planner.assemble

    def spy(req: Any, prompt: Any, ids: Any) -> Any:
        plan = assemble(req, prompt, ids)
        engine.lm_inputs += [list(text) for text, _, _ in plan.segments]
        return plan

    engine.planner.assemble = spy  # type: ignore[method-assign]
    with serving(web.create_app(engine, ui_lang="en", studio_later=True)) as url:
        yield url.rstrip("/"), engine


def lab_page(context: Any, url: str, errors: list[str]) -> Any:
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", state="attached")
    return page


def take_audio(page: Any, label: str) -> np.ndarray:
    js = """async (label) => {
      const r = window.labState.results.find((x) => x.label === label);
      const bytes = new Uint8Array(await (await fetch(r.url)).arrayBuffer());
      let bin = ""; bytes.forEach((b) => { bin += String.fromCharCode(b); });
      return btoa(bin);
    }"""
    data = base64.b64decode(page.evaluate(js, label))
    return sf.read(io.BytesIO(data), dtype="float32")[0]


def test_compare_play_favourite_code_share_blind_and_lexicon(browser, server, tmp_path) -> None:
    server, engine = server
    errors: list[str] = []
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = lab_page(context, f"{server}/lab?lang=en", errors)
    page.fill("#lab-text", TEXT)
    voices = page.eval_on_selector_all("#lab-voice option", "os => os.map(o => o.value)")
    assert len(voices) >= 2
    rows = page.locator(".lab-take-row")
    rows.nth(1).locator("select").select_option(voices[1])
    rows.nth(2).locator("input").first.fill("Speak happily.")
    rows.nth(3).locator("input[type=number]").nth(1).fill("1.5")
    page.click("#lab-generate")
    page.wait_for_selector("#lab-results[data-done='true']")
    cards = page.locator(".lab-result")
    assert cards.count() == 4 and page.locator(".lab-result[data-state=done]").count() == 4
    assert page.locator(".lab-result .lab-diff").count() >= 4  # seed on each, voice / instruct / speed
    assert "TTFA" in cards.first.inner_text() and page.locator(".lab-wave").count() == 4

    for index in (0, 1):  # play two
        cards.nth(index).locator("[data-act=play]").click()
        page.wait_for_function(f"(window.labState.results[{index}].played || 0) > 0")
    cards.nth(2).locator("[data-act=favourite]").click()
    assert cards.nth(2).locator("[data-act=favourite]").get_attribute("aria-pressed") == "true"
    assert page.evaluate("window.labState.results.map(r => !!r.favourite)") == [False, False, True, False]

    cards.first.locator("[data-act=code]").click()
    page.wait_for_function("document.getElementById('lab-code-text').textContent.includes('extra_body')")
    snippet = page.inner_text("#lab-code-text")
    assert server + "/v1" in snippet and '"seed": 1000' in snippet
    env = {k: v for k, v in os.environ.items() if k != "COSYSTREAM_API_KEY"}
    subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, check=True, timeout=WAIT_S)
    again = sf.read(tmp_path / "take.wav", dtype="float32")[0]
    original = take_audio(page, "A")
    assert again.shape == original.shape and np.abs(again - original).max() <= ATOL

    cards.nth(3).locator("[data-act=regenerate]").click()  # another draw: a new seed, the rest kept
    page.wait_for_function(
        "window.labState.results[3].status === 'done' && window.labState.results[3].settings.seed !== 1003"
    )
    assert page.evaluate("window.labState.results[3].settings.speed") == 1.5

    page.click("#lab-share")
    link = page.input_value("#lab-share-url")
    other = lab_page(browser.new_context(viewport={"width": 390, "height": 844}), link, errors)
    assert other.input_value("#lab-text") == TEXT
    restored = other.evaluate("window.labState.rows.map(r => [r.voice, r.instruct, r.seed, r.speed])")
    assert restored == [
        ["", "", "1000", ""], [voices[1], "", "1001", ""],
        ["", "Speak happily.", "1002", ""], ["", "", "1003", "1.5"],
    ]  # fmt: skip
    other.context.close()

    page.fill("#lab-lex-name", "Brands")
    page.fill("#lab-lex-entries", "Nike = N AY1 K IY0")
    page.click("#lab-lex-save")
    page.wait_for_function("document.getElementById('lab-lexicon').options.length > 1")
    page.click("#lab-lex-try")
    page.wait_for_selector("#lab-lex-out mark")
    assert "[N][AY1][K][IY0]" in page.inner_text("#lab-lex-out")
    page.select_option("#lab-lexicon", "brands")
    engine.lm_inputs.clear()

    page.check("#lab-blind")
    page.click("#lab-generate")
    page.wait_for_selector("#lab-results[data-done='true']")
    assert "Take A" not in page.inner_text("#lab-results")  # labels hidden
    order = page.evaluate("window.labState.order")
    assert order != [0, 1, 2, 3]
    page.locator(".lab-result").nth(0).get_by_label("Rating 5").click()
    page.locator(".lab-result").nth(1).get_by_label("Rating 2").click()
    page.click("#lab-reveal")
    assert "Winner" in page.inner_text("#lab-status") and "Take" in page.inner_text("#lab-results")
    assert page.locator(".lab-applied").count() == 4 and "Nike×1" in page.inner_text(".lab-applied >> nth=0")
    tok = engine.text.tokenizer
    hint = ",".join(str(tok.token_id(t)) for t in ("[N]", "[AY1]", "[K]", "[IY0]"))
    assert len(engine.lm_inputs) >= 4 and all(hint in ",".join(map(str, ids)) for ids in engine.lm_inputs)
    with page.expect_download() as got:
        page.click("#lab-export-csv")
    csv_text = got.value.path().read_text(encoding="utf-8")
    assert csv_text.startswith("take,position,blind,rating") and len(csv_text.splitlines()) == 5

    page.fill("#lab-lex-entries", "Nike = N AY9")
    page.click("#lab-lex-save")
    page.wait_for_selector("#lab-notice[data-kind=error]")
    assert "AY9" in page.inner_text("#lab-notice")
    assert errors == []
    context.close()
