"""engine/text/checks.py: the one table of text checks. The engine's planner (the studio's and the CLI's
door) applies it as the API's routes do (tests/api/test_contract.py, tests/api/test_realtime.py), so each
bad text has one code wherever it comes in."""

from __future__ import annotations

import pytest

from engine.config import Limits
from engine.errors import InvalidInput, TooLarge, shown
from engine.request import SynthesisRequest
from engine.serving.plan import Planner
from engine.text.checks import check_text, speakable

BAD = [
    ("\U0001f600\U0001f389", InvalidInput, "nothing_to_speak"),
    ("\u200b\u0301 ...", InvalidInput, "nothing_to_speak"),
    ("[breath]", InvalidInput, "nothing_to_speak"),  # a tag alone says nothing
    ("Hi \x00 there", InvalidInput, "control_characters"),
    ("Hi \ud800 there", InvalidInput, "invalid_unicode"),
    ("<speak>Hi</speak>", InvalidInput, "unsupported_markup"),
    ("Hi [foo]", InvalidInput, "unsupported_markup"),
    ("Hi <break/>", InvalidInput, "invalid_break"),
    ('Hi <break time="11s"/>', InvalidInput, "break_too_long"),
    ('Hi <break time="10s"/>' * 31, TooLarge, "too_much_silence"),
    ("x" * 2001, TooLarge, "text_too_long"),
]


@pytest.mark.parametrize(("text", "error", "code"), BAD)
def test_each_bad_text_has_its_code(text: str, error: type[Exception], code: str) -> None:
    with pytest.raises(error) as refused:
        check_text(text, "input", "text", 2000, spoken=True, family="cosyvoice3")
    assert refused.value.code == code and refused.value.field == "text"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "error", "code"), BAD)
def test_the_engines_planner_applies_the_same_table(text: str, error: type[Exception], code: str) -> None:
    """Before: the planner had its own checks (no markup, no emoji, no breaks): the studio spoke them."""
    planner = Planner(None, None, None, "cosyvoice3", Limits())  # type: ignore[arg-type]  # check() only
    with pytest.raises(error) as refused:
        planner.check(SynthesisRequest(text=text, prompt_wav="p.wav"))
    assert refused.value.code == code  # type: ignore[attr-defined]


def test_what_passes() -> None:
    for text in ("Hello [breath] there <strong>now</strong>.", '你好 <break time="1.5s"/> 世界', "42"):
        check_text(text, "input", "text", 2000, spoken=True, family="cosyvoice3")
    check_text("\U0001f600", "ref_text", "prompt_text", 2000)  # not spoken: only characters are checked
    assert speakable("a\U0001f600") and not speakable("\U0001f600 [laughter]")


def test_quotes_are_bounded() -> None:
    assert shown("m" * 100_000).endswith("... (100000 characters)") and len(shown("m" * 100_000)) < 80


def test_a_text_of_pronunciation_tokens_alone_is_speech_for_the_family_that_has_them():
    """A lexicon's hint (``Nike.`` -> ``[N][AY1][K][IY0].``) is what v3 says, not markup to strip; v2 has no
    such tokens, and a model tag alone (``[breath]``) is still nothing to say."""
    hint = "[N][AY1][K][IY0]."
    assert speakable(hint, "cosyvoice3")
    assert not speakable(hint) and not speakable(hint, "cosyvoice2")
    assert not speakable("[breath]", "cosyvoice3")
    check_text(hint, "input", "input", 100, spoken=True, family="cosyvoice3")
    with pytest.raises(InvalidInput) as refused:
        check_text("[breath].", "input", "input", 100, spoken=True, family="cosyvoice3")
    assert refused.value.code == "nothing_to_speak"
