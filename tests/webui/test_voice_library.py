"""webui/voice_library.py against the fake engine: the cards, using a voice in each kind of mode, rename,
delete with undo, and a stranger's voice left alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.config import Limits
from engine.voices import load_examples
from tests.fakes import FakeEngine
from tests.sounds import write_wav
from webui.handlers import Studio
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts
from webui.voice_library import VoiceShelf, library_html

BROWSER_A, BROWSER_B = "a" * 32, "b" * 32


class ExampleEngine(FakeEngine):
    def example_voices(self) -> list[Any]:
        return list(load_examples())


@pytest.fixture
def shelf(tmp_path) -> Any:
    engine = ExampleEngine()
    engine.add_voice("Shared", str(write_wav(tmp_path / "s.wav", 3.0)), "A public one.", None)
    engine.add_voice("Mine", str(write_wav(tmp_path / "m.wav", 3.0)), "My own words.", "studio:" + BROWSER_A)
    studio = Studio(engine, Limits(), Texts("en"), StreamHub(), AudioStore(tmp_path / "store"))  # type: ignore[arg-type]
    return VoiceShelf(studio)


def act(op: str, voice: str, **more: Any) -> str:
    return json.dumps({"op": op, "voice": voice, **more})


async def test_the_cards_are_the_examples_then_public_and_own_voices(shelf) -> None:
    cards = await shelf.cards(BROWSER_A)
    examples = [e.id for e in load_examples()]
    assert [c.id for c in cards] == ["mine", *examples, "shared"]  # own first, public last
    assert [cards[0].kind, cards[-1].kind] == ["own", "public"]
    page = library_html(cards, Texts("zh"))
    assert page.count('data-lib-op="play"') == len(cards) and page.count('data-lib-op="delete"') == 1
    assert "示例 · 日本語" in page and "(Japanese)" not in page  # the language named in itself
    assert [c.id for c in await shelf.cards(BROWSER_B)][-1] == "shared"  # not A's own


async def test_a_card_fills_the_prompt_or_picks_the_saved_voice(shelf) -> None:
    prompt, text, _, _, page, _ = await shelf.act(act("use", "mine"), "zero_shot", BROWSER_A, [])
    assert (
        Path(prompt).read_bytes()
        == Path(shelf.studio.engine.voices[("studio:" + BROWSER_A, "mine")].wav).read_bytes()
    )
    assert text == "My own words." and "Using “Mine”" in page
    out = await shelf.act(act("use", "shared"), "voice", BROWSER_A, [])
    assert out[3].value == "shared" and not isinstance(out[0], str)  # the list picks it, not the prompt
    out = await shelf.act(act("use", "en-amy"), "cross_lingual", BROWSER_A, [])
    assert out[1] == load_examples()[0].transcript and out[2] == "en"


async def test_delete_then_undo_brings_the_voice_back(shelf) -> None:
    engine = shelf.studio.engine
    *_, voice, page, trash = await shelf.act(act("delete", "mine"), "voice", BROWSER_A, [])
    assert ("studio:" + BROWSER_A, "mine") not in engine.voices
    assert 'data-lib-op="undo" data-voice="mine"' in page and "mine" not in [c[1] for c in voice.choices]
    *_, voice, page, trash = await shelf.act(act("undo", "mine"), "voice", BROWSER_A, trash)
    restored = engine.voices[("studio:" + BROWSER_A, "mine")]
    assert restored.prompt_text == "My own words." and "Restored voice “Mine”" in page and trash == []
    assert "mine" in [c[1] for c in voice.choices]


async def test_rename_keeps_the_recording_and_the_words(shelf) -> None:
    engine = shelf.studio.engine
    *_, voice, page, _ = await shelf.act(act("rename", "mine", name="Calm me"), "voice", BROWSER_A, [])
    assert ("studio:" + BROWSER_A, "mine") not in engine.voices
    assert engine.voices[("studio:" + BROWSER_A, "calm me")].prompt_text == "My own words."
    assert voice.value == "calm me" and "Renamed “Mine” to “Calm me”" in page


@pytest.mark.parametrize(
    ("browser", "op", "voice"),
    [(BROWSER_B, "delete", "mine"), (BROWSER_A, "delete", "shared"), (BROWSER_A, "delete", "en-amy"),
     (BROWSER_A, "undo", "mine"), (BROWSER_A, "use", "../etc"), (BROWSER_A, "drop", "mine")],
)  # fmt: skip
async def test_what_is_not_yours_stays(shelf, browser, op, voice) -> None:
    before = dict(shelf.studio.engine.voices)
    out = await shelf.act(act(op, voice), "voice", browser, [])
    assert shelf.studio.engine.voices == before and len(out) == 6
