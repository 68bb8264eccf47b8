"""The studio's words at 1440x900 in headless Chromium (the fake engine, in process).

A Chinese page shows no English word except names and units (``ALLOWED``, each with its reason), in every
mode, in its error toast and in the component config (labels, choices, placeholders the page has not
opened yet); every metric tile's label and value fit their tile in both languages, with the widest values
a request can produce. Writes ``test-output/studio-labels-{en,zh-zh,auto-zh}.png``.
"""

from __future__ import annotations

import re
from html import unescape
from typing import Any

import pytest

from engine.serving.metrics import RequestMetrics
from tests.fakes import FakeEngine
from tests.webui.support import OUT, WAIT_MS, serving
from webui import views
from webui.handlers import UI_MODES
from webui.script_tab import TAG_KEYS
from webui.texts import Texts

pytestmark = pytest.mark.browser

ALLOWED = {
    "CosyStream",  # the product's name
    "Gradio", "API",  # the framework's footer ("通过 API 使用", "使用 Gradio 构建")
    "English",  # the English language's own name in the language list, as 日本語 and 한국어 are theirs
    "HiFT", "RTF",  # the vocoder's name; the real-time factor, the field's unit name
    "v3",  # the model version ("v3 的系统提示词")
    "Hz", "kHz", "ms", "s", "MB", "wav", "mp3", "flac", "SRT", "WebVTT",  # units and file formats
}  # fmt: skip
WORD = re.compile(r"[A-Za-z][A-Za-z0-9'-]*")
ALLOWED |= set(
    WORD.findall(" ".join(TAG_KEYS))
)  # the script's tag markup ([breath], <break time=...>) as typed
FLAG = re.compile(r"--[a-z][a-z-]*")  # a command-line flag (--model) is typed as is

# the visible text, the placeholders and our own titles; the example texts are sample sentences in their own
# languages (data, not labels), and Gradio's untranslated aria-labels are not shown
PAGE_WORDS_JS = """() => {
  const examples = document.querySelector('#cosy-example-texts');
  if (examples) examples.style.display = 'none';
  const out = [document.body.innerText];
  if (examples) examples.style.display = '';
  for (const el of document.querySelectorAll('[placeholder]')) out.push(el.getAttribute('placeholder'));
  return out.join('\\n');
}"""
TILES_JS = """() => [...document.querySelectorAll('.cosy-metrics .cosy-tile, .cosy-metrics .cosy-tile > *')]
  .map((el) => ({text: el.textContent, scroll: el.scrollWidth, client: el.clientWidth}))"""


def english_words(text: str, names: set[str]) -> set[str]:
    words = set(WORD.findall(FLAG.sub(" ", text)))
    return {w for w in words if w not in ALLOWED and w not in names}


def config_texts(config: dict[str, Any]) -> str:
    """Every label, info, placeholder, choice label and button / HTML text the page's config carries."""
    out = []
    for comp in config["components"]:
        props = comp.get("props", {})
        out += [str(props.get(k) or "") for k in ("label", "info", "placeholder")]
        out += [str(choice[0]) for choice in props.get("choices") or []]
        if comp.get("type") in ("button", "html") and isinstance(props.get("value"), str):
            out.append(unescape(re.sub(r"<[^>]+>", " ", props["value"])))  # tags, then entities
    return "\n".join(out)


SESSIONS = [("zh", "zh"), ("auto", "zh"), ("en", "en")]  # (--ui-lang, the browser's language)


@pytest.fixture(scope="module", params=SESSIONS, ids=lambda p: "-".join(p))
def studio(request, browser) -> Any:
    """(ui_lang, language, page, names) on a 1440x900 studio (--ui-lang forced, or auto: following the
    browser), with a browser of that language's locale."""
    from server import web

    engine = FakeEngine()
    ui_lang, lang = request.param
    with serving(web.create_app(engine, ui_lang=ui_lang, random_weights=True)) as url:
        locale = "zh-CN" if lang == "zh" else "en-US"
        page = browser.new_page(viewport={"width": 1440, "height": 900}, locale=locale)
        page.goto(url)
        page.wait_for_function("window.cosyPlayer && document.getElementById('cosy-live')", timeout=WAIT_MS)
        # the page's load event renders the server's texts in the session's language, and the voice
        # libraries once the page's owner id has come (auto: both first render in English)
        texts = Texts(lang)
        for selector, key in ((".cosy-title", "title"), (".cosy-lib-title", "library_title")):
            found = f"[...document.querySelectorAll('{selector}')]"
            page.wait_for_function(
                f"(t) => {found}.length > 0 && {found}.every((el) => el.textContent === t)",
                arg=texts(key),
                timeout=WAIT_MS,
            )
        yield ui_lang, lang, page, {engine.model_name, engine.family}
        page.close()


def test_a_chinese_page_has_no_english_but_names_and_units(studio, request) -> None:
    ui_lang, lang, page, names = studio
    if lang != "zh":
        pytest.skip("the English page may be English")
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / f"studio-labels-{request.node.callspec.id}.png"))
    assert not english_words(page.evaluate(PAGE_WORDS_JS), names)
    if ui_lang == "zh":  # auto: the config is the English first render, with i18n keys the browser resolves
        config = page.evaluate("fetch('config').then((r) => r.json())")
        assert not english_words(config_texts(config), names)
    for mode in ("跨语种", "指令控制", "声音转换", "已存音色", "零样本克隆"):
        page.locator("#cosy-mode").get_by_text(mode, exact=True).click()
        page.wait_for_function(
            "(help) => document.body.innerText.includes(help)", arg=Texts("zh")(_help(mode)), timeout=WAIT_MS
        )
        assert not english_words(page.evaluate(PAGE_WORDS_JS), names), mode
    page.locator("#cosy-generate").click()  # nothing filled in: the status says why
    said = page.locator('.cosy-status[data-state="refused"]')
    try:
        said.wait_for(timeout=WAIT_MS)
    except Exception:  # playwright's TimeoutError, seen once on a loaded machine: keep what the page showed
        page.screenshot(path=str(OUT / f"studio-labels-no-refusal-{request.node.callspec.id}.png"))
        raise
    assert said.inner_text().startswith(Texts("zh")("status_refused", message=""))
    assert not english_words(page.evaluate(PAGE_WORDS_JS), names)
    page.locator("#cosy-script .label-wrap").first.click()  # the script desk, its notes re-rendered on load
    sigh = Texts("zh")("script_tag_sigh")
    page.wait_for_function("(s) => document.body.innerText.includes(s)", arg=sigh, timeout=WAIT_MS)
    assert not english_words(page.evaluate(PAGE_WORDS_JS), names)


def _help(mode_label: str) -> str:
    zh = Texts("zh")
    return next(f"mode_help_{m}" for m in UI_MODES if zh(f"mode_{m}") == mode_label)


def test_every_metric_tile_fits_at_1440x900(studio) -> None:
    """The tiles as the page first shows them, then with the widest values a request produces."""
    _, lang, page, _ = studio
    page.locator(".cosy-metrics").scroll_into_view_if_needed()
    OUT.mkdir(exist_ok=True)
    if lang == "en":
        page.screenshot(path=str(OUT / "studio-labels-en.png"))
    widest = RequestMetrics(
        request_id="f" * 32, seed=2**31 - 1, ttfa_ms=123_456.0, lm_tokens=123_456, lm_tokens_per_s=12_345.6,
        queue_wait_ms=123_456.0, audio_s=12_345.67, elapsed_ms=1_234_567.0,  # RTF: 100.0
        stage_ms={"frontend": 1.0, "lm": 2.0, "flow": 3.0, "hift": 4.0},
    )  # fmt: skip
    for html in (None, views.metrics_html(widest, Texts(lang))):
        if html is not None:
            page.evaluate("(h) => { document.querySelector('.cosy-metrics').outerHTML = h; }", html)
        tiles = page.evaluate(TILES_JS)
        assert len(tiles) == 30  # 10 tiles, each with its label and value
        cut = [t for t in tiles if t["scroll"] > t["client"]]
        assert not cut, cut
