"""Both UI languages carry the same keys with the same format fields."""

from __future__ import annotations

import string

import pytest

from webui.texts import EN, LANGUAGES, ZH, Texts


def fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def test_zh_and_en_have_the_same_keys_and_fields() -> None:
    assert set(EN) == set(ZH)
    for key in EN:
        assert fields(EN[key]) == fields(ZH[key]), key
        assert ZH[key].strip(), key


def test_every_language_has_a_label() -> None:
    for lang in LANGUAGES:
        assert Texts("zh")(f"lang_{lang}") and Texts("en")(f"lang_{lang}")


def test_lookup_formats_and_fails_loudly() -> None:
    assert Texts("en")("err_text_long", chars=5, limit=3) == (
        "The text has 5 characters; the limit is 3. Shorten it or split it."
    )
    assert Texts("zh")("generate") == "生成"
    with pytest.raises(KeyError):
        Texts("en")("no_such_label")
    with pytest.raises(ValueError, match="ui language"):
        Texts("fr")


def nested(text: str) -> bool:
    """Brackets inside brackets, ASCII or full-width: "busy (shutting down (another replica))"."""
    depth = 0
    for ch in text:
        if ch in "(（":
            depth += 1
            if depth > 1:
                return True
        elif ch in ")）":
            depth = max(0, depth - 1)
    return False


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_no_message_nests_brackets_whatever_fills_it(lang) -> None:
    """Issue 54: messages read in one voice; a language name carries its own brackets ("日本語 (日语)")."""
    t = Texts(lang)
    names = [t(f"lang_{code}") for code in LANGUAGES]
    for key, template in (EN if lang == "en" else ZH).items():
        if "{language}" in template and not nested(template):
            for name in names:
                filled = template.replace("{language}", name)
                assert not nested(filled), (key, filled)
        else:
            assert not nested(template), key
    assert nested("busy (the server (another replica))") and not nested("a (b) c (d)")
